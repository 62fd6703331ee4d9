"""Pure policy-gradient math (GRPO advantages, PPO clip loss, KL estimators, log-probs)."""

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
