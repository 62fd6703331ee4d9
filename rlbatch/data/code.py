"""Code tasks: prompts whose answer is a program checked by hidden tests.

A code problem's ``Sample.answer`` is a JSON object (``encode_tests``): the text put before the
response (``prefix``, e.g. a function header the prompt ends with) and the test statements
(``tests``, each an ``assert``). The ``code_sandbox`` role runs ``prefix + code`` then each test.

- ``synthetic_code_problems()``: the built-in task, small enough to learn from random init on a
  CPU. The prompt gives ``f(1)`` and ``f(2)`` of a hidden ``f(x) = x + c`` or ``x - c`` as
  ``"4=5="``; the program is ``def f(x): return x+`` (or ``x-``) followed by the response, so the
  right response is the constant (``3``); one test passes for any well-formed answer, six check
  ``f``'s values. Like the arithmetic task, it is a lookup a tiny model learns by RL alone; it
  exercises the sandbox path end to end, not coding skill.
- ``code_file_problems()``: MBPP-style (``text``/``prompt``, ``test_list``/``tests``) and
  HumanEval-style (``prompt``, ``test`` defining ``check(candidate)``, ``entry_point``) records
  from a local jsonl/parquet file.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from rlbatch.data.records import JsonObject, load_records
from rlbatch.data.synthetic import Sample
from rlbatch.errors import ConfigError

if TYPE_CHECKING:
    from rlbatch.config.schema import DataConfig

SYNTHETIC_PREFIX = "def f(x):\n    return x"
SYNTHETIC_POINTS = (0, 1, 2, 3, 5, 7)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def encode_tests(prefix: str, tests: list[str]) -> str:
    return json.dumps({"prefix": prefix, "tests": list(tests)}, sort_keys=True)


def decode_tests(answer: str) -> tuple[str, list[str]]:
    """``(prefix, tests)`` of a code problem's answer; a clear error for anything else."""
    try:
        spec = json.loads(answer)
        return str(spec.get("prefix", "")), [str(t) for t in spec["tests"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a code problem's answer (JSON with 'tests'): {answer[:80]!r}") from exc


def extract_code(text: str) -> str:
    """The program in a response: the first fenced block if there is one, else the whole text."""
    fenced = _FENCE.search(text)
    return fenced.group(1) if fenced else text


def synthetic_code_problems(ops: str = "+-", constants: range = range(10)) -> tuple[Sample, ...]:
    """``f(x) = x <op> c`` for each op and constant (``x-0`` is ``x+0``: once). The prompt is
    ``"f(1)=f(2)="`` as digits; the program is ``def f(x): return x<op>`` followed by the
    response, so the right response is the constant. A wrong constant passes only the first test
    (well-formed code), none of the value tests."""
    problems = []
    for op in ops:
        for c in constants:
            if op != ops[0] and c == 0:
                continue

            def f(x: int, op: str = op, c: int = c) -> int:
                return x + c if op == "+" else x - c if op == "-" else x * c

            # The first test passes for any well-formed answer (a small reward that leads a random
            # policy to valid code, as the arithmetic task's format bonus does); the others check values.
            tests = ["assert isinstance(f(0), int)", *(f"assert f({x}) == {f(x)}" for x in SYNTHETIC_POINTS)]
            problems.append(Sample(prompt=f"{f(1)}={f(2)}=", answer=encode_tests(SYNTHETIC_PREFIX + op, tests)))
    return tuple(problems)


def _record_problem(r: JsonObject, template: str) -> Sample:
    if "test_list" in r or "tests" in r:  # MBPP
        given = r.get("test_list") or r.get("tests") or []
        if isinstance(given, str):
            tests = [t for t in given.splitlines() if t.strip()]
        elif isinstance(given, list | dict):
            tests = [str(t) for t in given]
        else:  # a number or true: what iterating it raises
            raise TypeError(f"'{type(given).__name__}' object is not iterable")
        setup = str(r.get("test_setup_code") or "")
        text = r.get("text") or r.get("prompt") or r.get("question")
        return Sample(template.format(question=text), encode_tests("", [*([setup] if setup else []), *tests]))
    if "test" in r and "entry_point" in r:  # HumanEval: the prompt is the function's header and docstring
        return Sample(template.format(question=r["prompt"]),
                      encode_tests(str(r["prompt"]), [str(r["test"]), f"check({r['entry_point']})"]))
    raise ConfigError(f"data: a code record needs 'test_list'/'tests' (MBPP) or 'test' and 'entry_point' (HumanEval); "
                      f"its fields are {sorted(r)}")


def code_file_problems(data_cfg: DataConfig) -> tuple[Sample, ...]:
    rows = load_records(str(data_cfg.path))
    if not rows:
        raise ConfigError(f"data.path: {data_cfg.path} has no records")
    return tuple(_record_problem(r, str(data_cfg.template)) for r in rows)
