"""Math answer verification (rlbatch/rewards/math.py), format rewards, and routing by data_source."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlbatch.rewards import RewardError
from rlbatch.rewards.math import (
    boxed_format,
    equivalent,
    gsm8k_match,
    last_boxed,
    math_match,
    think_format,
)
from rlbatch.rewards.rules import rule_scorer

# (prediction, reference, equivalent?): numbers, separators, fractions, latex, percentages, expressions.
PAIRS = [
    ("72", "72", True),
    ("72.0", "72", True),
    ("72.00", "72", True),
    ("1,000", "1000", True),
    ("1,234,567", "1234567", True),
    ("-5", "-5", True),
    ("+5", "5", True),
    ("0.5", ".5", True),
    ("1/2", "0.5", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("\\tfrac{3}{4}", "0.75", True),
    ("\\frac{3}{4}", "\\frac34", True),
    ("\\frac{a}{b}", "a/b", True),
    ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("50\\%", "50", True),
    ("50%", "0.5", True),
    ("12.5\\%", "\\frac{1}{8}", True),
    ("$18", "18", True),
    ("\\$18", "18", True),
    ("5\\text{ cm}", "5", True),
    ("10^{2}", "100", True),
    ("3 \\cdot 4", "12", True),
    ("x+1", "1+x", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("\\infty", "\\infty", True),
    ("007", "7", True),
    ("18.", "18", True),
    ("72", "73", False),
    ("72", "-72", False),
    ("1,000", "100", False),
    ("12", "12.5", False),
    ("0.333", "1/3", False),
    ("1/3", "0.33", False),
    ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ("\\sqrt{2}", "1.414", False),
    ("\\pi", "3.14159", False),
    ("x+1", "x-1", False),
    ("2x", "x^2", False),
    ("50\\%", "5", False),
    ("", "5", False),
    ("5", "", False),
    ("seven", "7", False),
    ("1,2", "12", False),
]


@pytest.mark.parametrize(("prediction", "reference", "same"), PAIRS)
def test_equivalent_answers(prediction: str, reference: str, same: bool) -> None:
    assert equivalent(prediction, reference) is same


def test_the_table_holds_at_least_forty_pairs_both_ways() -> None:
    assert len(PAIRS) >= 40
    assert sum(s for *_, s in PAIRS) >= 15 and sum(not s for *_, s in PAIRS) >= 15


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed{5}.", "5"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
        ("\\fbox{x}", "x"),
        ("\\boxed 7 apples", "7"),
        ("$\\boxed{3}$", "3"),
        ("no box", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_last_boxed_reads_nested_braces(text: str, boxed: str | None) -> None:
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("She sold 48+24 = 72 clips.\n#### 72<|im_end|>", "Natalia sold 48/2 = 24...\n#### 72", 1.0),
        ("48 + 24 = 72, so 72 clips<|im_end|>", "#### 72", 1.0),
        ("The total is \\boxed{1,080} dollars.", "1080", 1.0),
        ("#### 72 and then 73", "72", 1.0),  # the '####' line's answer, not the last number
        ("She sold 72 clips<|im_end|> 73", "#### 72", 1.0),  # text after the stop marker is ignored
        ("It is 71.", "#### 72", 0.0),
        ("no number at all", "#### 72", 0.0),
        ("so 72", "Natalia sold 48/2 = 24 clips.\nShe sold 72 in all", 1.0),  # a worked answer without '####'
    ],
)
def test_gsm8k_match(completion: str, answer: str, reward: float) -> None:
    assert gsm8k_match(completion, answer) == reward


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("Thus the answer is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}<|im_end|>", "The probability is $\\boxed{\\frac12}$.", 1.0),  # MATH solutions box theirs
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
        ("the answer is 0.5", "\\frac{1}{2}", 0.0),  # MATH-style answers must be boxed
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("<|im_end|>\\boxed{0.5}", "0.5", 0.0),
    ],
)
def test_math_match(completion: str, answer: str, reward: float) -> None:
    assert math_match(completion, answer) == reward


@pytest.mark.parametrize(
    ("completion", "boxed", "think"),
    [
        ("<think>48/2 = 24</think> The answer is \\boxed{72}.<|im_end|>", 1.0, 1.0),
        ("48/2 = 24</think>\\boxed{72}", 1.0, 1.0),  # the template opened the block
        ("<think>reasoning</think>", 0.0, 0.0),  # nothing after the block
        ("<think></think>\\boxed{72}", 1.0, 0.0),  # no reasoning
        ("<think>a</think><think>b</think>\\boxed{1}", 1.0, 0.0),
        ("\\boxed{}", 0.0, 0.0),
        ("72<|im_end|>\\boxed{72}", 0.0, 0.0),
    ],
)
def test_format_rewards(completion: str, boxed: float, think: float) -> None:
    assert boxed_format(completion, "ignored") == boxed
    assert think_format(completion, "ignored") == think


def test_latex_is_verified_off_the_main_thread() -> None:
    """math-verify times out with SIGALRM, which only the main thread may set; a scorer on another
    thread must still compare latex (equivalent() runs math-verify without its timeout there)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(equivalent("\\dfrac{2}{4}", "\\sqrt{\\frac{1}{4}}")))
    t.start()
    t.join(60)
    assert out == [True]


# ------------------------------------------------------------------------------ routing by data_source


def _scorer(**data: Any) -> Any:
    return rule_scorer(SimpleNamespace(data=SimpleNamespace(**{"reward_fn": "rlbatch.rewards:exact_match", **data})))


def test_each_data_source_is_scored_by_its_route_and_others_by_the_default() -> None:
    score = _scorer(reward_fns={"openai/gsm8k": "rlbatch.rewards:gsm8k_match",
                                "lighteval/MATH": "rlbatch.rewards.math:math_match"})
    completions = ["#### 72<eos>", "\\boxed{\\frac{1}{2}}<eos>", "0.5<eos>", "7<eos>", "#### 72<eos>"]
    answers = ["72", "0.5", "0.5", "7", "72"]
    sources = ["openai/gsm8k", "lighteval/MATH", "lighteval/MATH", "unrouted/source", ""]
    rewards, _ = score(completions, answers, sources)
    # gsm8k route; math route (boxed); math route (not boxed); default exact match for a source it
    # does not name; a sample without a source gets the default too.
    assert rewards == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert score(completions, answers)[0] == [0.0, 0.0, 1.0, 1.0, 0.0]  # no sources: the default for all


def test_a_failing_route_is_named_with_its_data_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rlbatch_test_routes.py").write_text("def boom(completion, answer):\n    raise KeyError(answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    score = _scorer(reward_fns={"src": "rlbatch_test_routes:boom"})
    assert score(["1<eos>"], ["1"])[0] == [1.0]
    with pytest.raises(RewardError) as e:
        score(["1<eos>"], ["7"], ["src"])
    assert str(e.value.for_sample(40)) == ("data.reward_fns['src'] 'rlbatch_test_routes:boom' on sample 40 (answer '7', "
                                           "completion '1<eos>') raised KeyError: '7'")
