"""Rule-based rewards on completions as the rollout decodes them, and loading by path."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbatch.rewards.rules import (
    answer_repeated,
    exact_match,
    exact_match_with_format,
    extract_answer,
    format_reward,
    leading_number_match,
    load_reward_fn,
    split_at_stop,
)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("7<eos><pad><pad>", "7", 1.0),
        ("7", "7", 1.0),  # ran out of tokens right after the answer
        (" 7 <eos>", "7", 1.0),
        ("73<eos>", "7", 0.0),  # extra digit: wrong number
        ("7=<eos>", "7", 0.0),  # strict: trailing junk is wrong
        ("<eos>7", "7", 0.0),  # the answer after the stop does not count
        ("8<eos>", "7", 0.0),
        ("17</s>", "17", 1.0),  # other common stop markers work too
    ],
)
def test_exact_match(completion: str, answer: str, expected: float) -> None:
    assert exact_match(completion, answer) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("7=3", "7", 1.0),
        ("7<eos>", "7", 1.0),
        ("07<eos>", "7", 1.0),  # compared as numbers
        ("-3<eos>", "-3", 1.0),
        ("x7", "7", 0.0),
        ("73", "7", 0.0),
        ("", "7", 0.0),
    ],
)
def test_leading_number_match(completion: str, answer: str, expected: float) -> None:
    assert leading_number_match(completion, answer) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("7" * 64, "7", 1.0),
        ("7" * 80, "7", 1.0),  # only the first 64 characters count
        ("7" * 32 + "<eos>", "7", 0.5),  # stopping early loses the rest
        ("7<eos>" + "7" * 63, "7", 1 / 64),  # nothing after the stop counts
        ("x7x7", "7", 2 / 64),  # every position counts, not just the first
        ("1212x12", "12", 2 / 32),  # read in answer-sized chunks: "x1" and "2" are not the answer
        ("8" * 64, "7", 0.0),
        ("", "7", 0.0),
        ("777", " ", 0.0),  # no answer to repeat
    ],
)
def test_answer_repeated(completion: str, answer: str, expected: float) -> None:
    assert answer_repeated(completion, answer) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("7<eos>", 1.0), ("12<eos><pad>", 1.0), ("7", 0.0), ("+<eos>", 0.0), ("<eos>", 0.0), ("7+1<eos>", 0.0)],
)
def test_format_reward(completion: str, expected: float) -> None:
    assert format_reward(completion, "ignored") == expected


def test_exact_match_with_format_gives_small_bonus_only_for_wrong_but_well_formed() -> None:
    assert exact_match_with_format("7<eos>", "7") == 1.0
    assert exact_match_with_format("8<eos>", "7") == pytest.approx(0.1)
    assert exact_match_with_format("8", "7") == 0.0
    assert exact_match_with_format("+<eos>", "7") == 0.0


def test_split_at_stop_uses_earliest_marker() -> None:
    assert split_at_stop("ab</s>cd<eos>") == ("ab", True)
    assert split_at_stop("ab<eos>cd</s>") == ("ab", True)
    assert split_at_stop("abc") == ("abc", False)
    assert extract_answer("  5 <eos> 6") == "5"


@pytest.mark.parametrize(
    "path", ["rlbatch.rewards.rules:exact_match", "rlbatch.rewards.rules.exact_match", " rlbatch.rewards:exact_match "]
)
def test_load_reward_fn_finds_function_by_either_syntax(path: str) -> None:
    assert load_reward_fn(path) is exact_match


def test_load_reward_fn_resolves_nested_attribute() -> None:
    assert load_reward_fn("rlbatch.rewards:rules.exact_match") is exact_match


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("rlbatch.rewards.rules:nope", "has no attribute 'nope'"),
        ("rlbatch.rewards.rules.nope", "has no attribute 'nope'"),
        ("rlbatch.rewards.rules:STOP_MARKERS", "not a callable"),
        ("exact_match", "must look like"),
        ("rlbatch.rewards.rules:", "must look like"),
        ("a:b:c", "must look like"),
        ("", "non-empty"),
    ],
)
def test_load_reward_fn_errors_name_the_path(path: str, reason: str) -> None:
    with pytest.raises(ValueError, match="reward function") as info:
        load_reward_fn(path)
    assert reason in str(info.value)
    if path.strip():
        assert repr(path.strip()) in str(info.value)


def test_load_reward_fn_never_evaluates_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(ValueError):
        load_reward_fn(f"__import__('pathlib').Path({str(marker)!r}).touch()")
    assert not marker.exists()
