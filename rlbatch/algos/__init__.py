"""Pure policy-gradient math (GRPO advantages, PPO clip loss, KL estimators, log-probs)
and the masks/positions that connect generated ids to it."""

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
