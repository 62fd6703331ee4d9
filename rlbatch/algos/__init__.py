"""Pure policy-gradient math (GRPO advantages, PPO clip loss, KL estimators, log-probs)
and the masks/positions that connect generated ids to it.

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
    from rlbatch.algos.sequence import completion_mask, pad_to_length, position_ids_from_mask

_HOME = {
    "ClipStats": "core", "aggregate": "core", "entropy_from_logits": "core", "grpo_advantages": "core",
    "kl_penalty": "core", "masked_mean": "core", "ppo_clip_loss": "core", "token_logprobs": "core",
    "completion_mask": "sequence", "pad_to_length": "sequence", "position_ids_from_mask": "sequence",
}

__all__ = [
    "ClipStats",
    "aggregate",
    "completion_mask",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "pad_to_length",
    "position_ids_from_mask",
    "ppo_clip_loss",
    "token_logprobs",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'rlbatch.algos' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rlbatch.algos.{_HOME[name]}"), name)
    globals()[name] = value
    return value
