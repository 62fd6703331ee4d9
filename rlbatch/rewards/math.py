"""Rewards for math answers: GSM8K-style (``#### 72``, the last number) and MATH-style (``\\boxed{}``).

Reward functions (``data.reward_fn`` or a ``data.reward_fns`` route):

- ``gsm8k_match``: the reference is the number after ``####`` (or the answer's last number); the
  completion's answer is what follows its own ``####``, else its last ``\\boxed{}``, else its last
  number.
- ``math_match``: the reference is the answer's last ``\\boxed{}`` (a MATH solution) or the whole
  answer (verl's ``ground_truth``); the completion must box its answer.
- ``boxed_format``, ``think_format``: 1.0 for the shape alone (a non-empty ``\\boxed{}``; a
  ``<think>...</think>`` block followed by an answer), whatever the answer.
- ``last_number_match``: the plain last-number rule (no equivalence beyond commas and ``.0``).

``equivalent(prediction, reference)`` decides whether two answers agree: plain numbers (with
thousands separators, decimals, ``a/b``) exactly as fractions, without sympy; anything else
through math-verify (latex ``\\frac``/``\\dfrac``, roots, simple expressions, sets, intervals),
whose parse and comparison stop after 5 s when called on a main thread (it times out with
SIGALRM, which only the main thread may set; elsewhere it runs without a limit). A percentage
matches both its number and its fraction (``50%`` is ``50`` and ``0.5``).
Everything is text in, float out: it runs wherever a rule reward runs, on the reward CPU workers.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache

from rlbatch.rewards.rules import split_at_stop

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_LEADING = re.compile(r"(?:\\?\$)?\s*(-?\d[\d,]*(?:\.\d+)?(?:\s*\\?%)?)(?![\d/^.]|\s*[-+*/^])")
_PLAIN = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?")
_RATIO = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")
_PERCENT = re.compile(r"(.*?)\s*\\?%")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_THINK = re.compile(r"\s*(?:<think>)?(?P<thought>.*?)</think>(?P<answer>.*)", re.DOTALL)


def _canonical(text: str) -> str | None:
    text = text.replace(",", "").strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else str(value)


def reference_number(answer: str) -> str | None:
    """The number after '####' in a GSM8K answer, or the answer itself when it is a number."""
    tail = answer.rsplit("####", 1)[-1]
    found = _NUMBER.findall(tail)
    return _canonical(found[-1]) if found else None


def last_number_match(completion: str, answer: str) -> float:
    """1.0 when the completion's last number (before its stop marker) equals the reference's."""
    want = reference_number(answer)
    found = _NUMBER.findall(split_at_stop(completion)[0])
    return 1.0 if want is not None and found and _canonical(found[-1]) == want else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces
    included; ``\\boxed 5`` gives ``5``; None when there is none or its braces do not close."""
    found: str | None = None
    for m in _BOX.finditer(text):
        at = m.end()
        if at < len(text) and text[at] == "{":
            depth = 0
            for i in range(at, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    found = text[at + 1 : i]
                    break
        else:
            word = re.match(r"[^\s$]+", text[at:])
            if word:
                found = word.group(0)
    return found


def gsm8k_answer(text: str) -> str | None:
    """What follows the last ``####`` on its line (the number it starts with, if it does), or None."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip().splitlines()
    line = tail[0].strip() if tail else ""
    lead = _LEADING.match(line)
    return lead.group(1) if lead else line or None


def _clean(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"^\\\$|^\\text\{\s*\$\s*\}", "", text).strip()  # a leading dollar sign (currency)
    return text.rstrip(".,").strip()


def _fraction(text: str) -> Fraction | None:
    """``text`` as an exact number when it is a plain decimal, integer or ``a/b``; else None."""
    t = text.replace(" ", "")
    if t and t not in "+-." and _PLAIN.fullmatch(t):
        return Fraction(t.replace(",", ""))
    ratio = _RATIO.fullmatch(t)
    if ratio and int(ratio.group(2)) != 0:
        return Fraction(int(ratio.group(1)), int(ratio.group(2)))
    return None


def _forms(text: str) -> list[str]:
    """The readings of an answer: itself, and for a percentage its number and its fraction."""
    text = _clean(text)
    pct = _PERCENT.fullmatch(text)
    if pct and pct.group(1):
        number = _clean(pct.group(1))
        value = _fraction(number)
        return [number, *([str(value / 100)] if value is not None else [f"({number})/100"])]
    return [text]


@lru_cache(maxsize=65536)
def _parsed(text: str, timeout: bool) -> tuple[object, ...]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return tuple(parse("\\boxed{" + text + "}", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                       parsing_timeout=5 if timeout else None))


@lru_cache(maxsize=65536)
def _same(prediction: str, reference: str) -> bool:
    a, b = _fraction(prediction), _fraction(reference)
    if a is not None and b is not None:
        return a == b
    from math_verify import verify

    timeout = threading.current_thread() is threading.main_thread()
    gold, target = _parsed(reference, timeout), _parsed(prediction, timeout)
    if not gold or not target:
        return False
    return bool(verify(list(gold), list(target), timeout_seconds=5 if timeout else None))


def equivalent(prediction: str, reference: str) -> bool:
    """Whether two answers are the same number or expression (see the module's docstring)."""
    if not prediction.strip() or not reference.strip():
        return False
    return any(_same(p, r) for p in _forms(prediction) for r in _forms(reference))


def gsm8k_match(completion: str, answer: str) -> float:
    """1.0 when the completion's answer (after its ``####``, else its last ``\\boxed{}``, else its
    last number) equals the reference number (after the answer's ``####``)."""
    want = gsm8k_answer(answer) or answer
    if _fraction(_clean(want)) is None and (numbers := _NUMBER.findall(want)):
        want = numbers[-1]  # a worked solution without '####': its last number
    text = split_at_stop(completion)[0]
    given = gsm8k_answer(text) or last_boxed(text)
    if given is None:
        found = _NUMBER.findall(text)
        given = found[-1] if found else None
    return 1.0 if given is not None and equivalent(given, want) else 0.0


def math_match(completion: str, answer: str) -> float:
    """1.0 when the completion's last ``\\boxed{}`` is equivalent to the reference (the answer's
    last ``\\boxed{}``, or the whole answer); 0.0 without a boxed answer."""
    given = last_boxed(split_at_stop(completion)[0])
    want = last_boxed(answer) or answer
    return 1.0 if given is not None and equivalent(given, want) else 0.0


def boxed_format(completion: str, answer: str) -> float:
    """1.0 when the completion (before its stop marker) boxes a non-empty answer; ignores ``answer``."""
    given = last_boxed(split_at_stop(completion)[0])
    return 1.0 if given is not None and given.strip() else 0.0


def think_format(completion: str, answer: str) -> float:
    """1.0 for ``<think>reasoning</think> answer``: one closed block of non-empty reasoning (its
    opening tag may be in the prompt, as reasoning models' templates put it), then a non-empty
    answer with no further think tags; ignores ``answer``."""
    m = _THINK.fullmatch(split_at_stop(completion)[0])
    if m is None or not m.group("thought").strip() or not m.group("answer").strip():
        return 0.0
    return 0.0 if "<think>" in m.group("thought") or "think>" in m.group("answer") else 1.0
