"""Rewards: rule functions (``rules``, and math answers and formats in ``math``; both re-exported here:
``data.reward_fn=rlbatch.rewards:exact_match``) and the code sandbox (``code``).

A scorer is a callable ``(completions, answers) -> (rewards, counts)`` (``Scorer``), where ``counts``
are per-step metrics; which one each CPU scoring role runs: ``rlbatch.loop.scorers``.
"""

from __future__ import annotations

from collections.abc import Callable

from rlbatch.rewards.math import (
    boxed_format,
    equivalent,
    gsm8k_match,
    last_number_match,
    math_match,
    think_format,
)
from rlbatch.rewards.rules import (
    STOP_MARKERS,
    RewardError,
    RewardFn,
    answer_repeated,
    exact_match,
    exact_match_with_format,
    extract_answer,
    format_reward,
    leading_number_match,
    load_reward_fn,
    split_at_stop,
)

__all__ = [
    "STOP_MARKERS",
    "RewardError",
    "RewardFn",
    "Scorer",
    "answer_repeated",
    "boxed_format",
    "equivalent",
    "exact_match",
    "exact_match_with_format",
    "extract_answer",
    "format_reward",
    "gsm8k_match",
    "last_number_match",
    "leading_number_match",
    "load_reward_fn",
    "math_match",
    "split_at_stop",
    "think_format",
]

Scorer = Callable[..., tuple[list[float], dict[str, int]]]
"""``scorer(completions, answers, sources=None) -> (rewards, counts)``: ``sources`` is each sample's
data source (None: the dataset names none)."""
