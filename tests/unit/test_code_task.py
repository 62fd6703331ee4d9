"""The code task (synthetic and file formats), code extraction, the code scorer and its validation."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.schema import RLBatchConfig, SandboxConfig
from rlbatch.data.code import (
    SYNTHETIC_PREFIX,
    code_file_problems,
    decode_tests,
    encode_tests,
    extract_code,
    synthetic_code_problems,
)
from rlbatch.data.tokenizer import DEFAULT_ALPHABET
from rlbatch.errors import ConfigError
from rlbatch.loop.scoring import weights
from rlbatch.rewards.code import CodeScorer


def test_synthetic_problems_are_distinct_and_solvable() -> None:
    problems = synthetic_code_problems()
    assert len(problems) == 19  # x+0..x+9, x-1..x-9
    assert len({p.prompt for p in problems}) == len(problems)
    for p in problems:
        assert set(p.prompt) <= set(DEFAULT_ALPHABET)
        prefix, tests = decode_tests(p.answer)
        assert prefix in (SYNTHETIC_PREFIX + "+", SYNTHETIC_PREFIX + "-") and len(tests) == 7
    plus3 = next(p for p in problems if p.prompt == "4=5=")
    ns: dict = {}
    assert decode_tests(plus3.answer)[0] == SYNTHETIC_PREFIX + "+"
    exec(SYNTHETIC_PREFIX + "+3", ns)  # noqa: S102 (our own program)
    for t in decode_tests(plus3.answer)[1]:
        exec(t, ns)  # noqa: S102


@pytest.mark.parametrize(("text", "code"), [
    ("+3", "+3"),
    ("here:\n```python\ndef f(x):\n    return 1\n```\ntrailing", "def f(x):\n    return 1\n"),
    ("```\nprint(1)\n```", "print(1)\n"),
    ("```py\nunterminated", "unterminated"),
])
def test_extract_code(text: str, code: str) -> None:
    assert extract_code(text) == code


def test_decode_refuses_non_code_answers() -> None:
    with pytest.raises(ValueError, match="not a code problem"):
        decode_tests("7")
    assert decode_tests(encode_tests("p", ["assert 1"])) == ("p", ["assert 1"])


def test_file_formats(tmp_path) -> None:
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"text": "Add one.", "test_list": ["assert inc(1) == 2"], "test_setup_code": ""}) + "\n")
    humaneval = tmp_path / "he.jsonl"
    humaneval.write_text(json.dumps({"prompt": "def inc(x):\n", "entry_point": "inc",
                                     "test": "def check(candidate):\n    assert candidate(1) == 2\n"}) + "\n")
    cfg = SimpleNamespace(path=str(mbpp), template="Q: {question}\n")
    [p] = code_file_problems(cfg)
    assert p.prompt == "Q: Add one.\n" and decode_tests(p.answer) == ("", ["assert inc(1) == 2"])
    [h] = code_file_problems(SimpleNamespace(path=str(humaneval), template="{question}"))
    prefix, tests = decode_tests(h.answer)
    assert prefix == "def inc(x):\n" and tests[-1] == "check(inc)"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ConfigError, match="test_list"):
        code_file_problems(SimpleNamespace(path=str(bad), template="{question}"))


def test_scorer_rewards_counts_and_cache() -> None:
    scorer = CodeScorer(SandboxConfig())
    answer = encode_tests("def f(x):\n    return x", ["assert f(1) == 4", "assert f(2) == 5", "assert f(0) == 0"])
    completions = ["+3<eos><pad>", "+3<eos>", "*4<eos>", "+<eos>", "```python\nwhile True: pass\n```"]
    rewards, counts = scorer.score(completions, [answer] * len(completions))
    assert rewards[:4] == [pytest.approx(2 / 3)] * 3 + [0.0]  # x*4: f(1) and f(0) right
    assert rewards[4] == 0.0  # "x" + the loop: a syntax error
    assert counts["sandbox/executions"] == 4 and counts["sandbox/cached"] == 1  # "+3" twice: run once
    assert counts["sandbox/tests_passed"] == 6 and counts["sandbox/tests_run"] == 15
    again, counts = scorer.score(["+3<eos>"], [answer])
    assert again == [pytest.approx(2 / 3)] and counts["sandbox/cached"] == 1
    strict = CodeScorer(SandboxConfig(scoring="all"))
    assert strict.score(["+3", "+3\n"], [answer, encode_tests("def f(x):\n    return x", ["assert f(1) == 4"])])[0] \
        == [0.0, 1.0]


def test_weights() -> None:
    assert weights({"reward": 1}, SandboxConfig()) == {"reward": 1.0}
    assert weights({"reward": 1, "code_sandbox": 1}, SandboxConfig()) == {"code_sandbox": 1.0}
    both = SandboxConfig(code_weight=0.7, rule_weight=0.3)
    assert weights({"reward": 1, "code_sandbox": 1}, both) == {"code_sandbox": 0.7, "reward": 0.3}


def _code_cfg(tmp_path, **sandbox) -> dict:
    c = dataclasses.asdict(RLBatchConfig())
    c["run_dir"] = str(tmp_path / "run")
    c["data"]["name"] = "synthetic_code"
    c["roles"]["code_sandbox"] = {"world_size": 1}
    c["roles"]["reward"]["enabled"] = False
    c["sandbox"].update(sandbox)
    return c


def _problems(cfg: dict) -> list[str]:
    try:
        check(cfg)
    except ConfigError as exc:
        return exc.problems
    return []


def test_validation(tmp_path) -> None:
    assert _problems(_code_cfg(tmp_path)) == []
    c = _code_cfg(tmp_path)
    del c["roles"]["code_sandbox"]
    assert any(p.startswith("roles.code_sandbox: data.name=synthetic_code") for p in _problems(c))
    c = _code_cfg(tmp_path)
    c["data"]["name"] = "synthetic"
    assert any("has none; use data.name=synthetic_code" in p for p in _problems(c))
    assert any("both 0" in p for p in _problems(_code_cfg(tmp_path, code_weight=0)))
    assert any(p.startswith("roles.reward: sandbox.rule_weight=0.5") for p in _problems(_code_cfg(tmp_path, rule_weight=0.5)))
    c = _code_cfg(tmp_path)
    c["sandbox"]["limits"]["memory_mb"] = 8
    assert any(p.startswith("sandbox.limits.memory_mb") and "got 8" in p for p in _problems(c))
    assert any("sandbox.isolation" in p and "docker" in p for p in _problems(_code_cfg(tmp_path, isolation="docker")))


def test_sandbox_bench_prints_each_ratio() -> None:
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools/bench/sandbox.py"), "--snippets", "4", "--parallel", "1",
                          "2", "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2].split()[0] == "1" and lines[-1].split()[0] == "2"
    assert all(line.count("x)") == 2 for line in lines[-2:]), lines  # namespaces and process, each against the floor
