"""Rule-based rewards ``fn(completion, answer) -> float`` and loading them by dotted path."""

from rlbatch.rewards.rules import (
    STOP_MARKERS,
    RewardFn,
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
    "RewardFn",
    "exact_match",
    "exact_match_with_format",
    "extract_answer",
    "format_reward",
    "leading_number_match",
    "load_reward_fn",
    "split_at_stop",
]
