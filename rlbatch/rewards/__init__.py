"""Rewards: rule functions (``rules``, and math answers and formats in ``math``; both re-exported here:
``data.reward_fn=rlbatch.rewards:exact_match``), the code sandbox (``code``), and which scores for which CPU role.

A CPU role that works in a ``score`` phase of the phase table gets the scorer named here: a
callable ``(completions, answers) -> (rewards, counts)``, where ``counts`` are per-step metrics.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

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
    "SCORERS",
    "STOP_MARKERS",
    "RewardError",
    "RewardFn",
    "Scorer",
    "answer_repeated",
    "boxed_format",
    "build_scorer",
    "reward_role_scorer",
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

SCORERS: dict[str, str] = {
    "reward": "rlbatch.rewards:reward_role_scorer",
    "code_sandbox": "rlbatch.rewards.code:code_scorer",
}
"""CPU role -> ``module:factory``; ``factory(cfg) -> Scorer``."""


def reward_role_scorer(cfg: Any) -> Scorer:
    """The reward role's scorer: ``data.reward_fn`` (``rules.rule_scorer``); in a run with an
    environment (``env.name``), each trajectory's env reward (``rlbatch.envs.scoring``)."""
    if getattr(getattr(cfg, "env", None), "name", None):
        from rlbatch.envs.scoring import env_scorer

        return env_scorer(cfg)
    from rlbatch.rewards.rules import rule_scorer

    return rule_scorer(cfg)


def build_scorer(role: str, cfg: Any) -> Scorer:
    if role not in SCORERS:
        raise KeyError(f"role {role!r} scores responses but no scorer is registered for it; scorers: {sorted(SCORERS)}")
    module, _, name = SCORERS[role].partition(":")
    factory: Callable[[Any], Scorer] = getattr(importlib.import_module(module), name)
    return factory(cfg)
