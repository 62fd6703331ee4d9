"""Rewards for math word problems (GSM8K style).

GSM8K reference answers end with ``#### <number>``; a completion is right when the last number
it states before its stop marker equals that number (commas and a trailing ``.0`` ignored).
"""

from __future__ import annotations

import re

from rlbatch.rewards.rules import split_at_stop

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


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
