"""Algorithms: pure policy-gradient math (``core``: GRPO advantages, PPO clip loss, KL estimators,
log-probs), the registries that name its parts (``registry``), and the objective engines
minimise (``objective``).

The math needs torch; ``rlbatch.algos.registry`` does not, and validation imports it before
anything starts. So the names below are imported on first use, not when the package is.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlbatch.algos.core import (
        ClipStats,
        aggregate,
        entropy_from_logits,
        grpo_advantages,
        kl_penalty,
        masked_mean,
        ppo_clip_loss,
        token_logprobs,
    )

__all__ = [
    "ClipStats",
    "aggregate",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "ppo_clip_loss",
    "token_logprobs",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'rlbatch.algos' has no attribute {name!r}")
    value = getattr(importlib.import_module("rlbatch.algos.core"), name)
    globals()[name] = value
    return value
