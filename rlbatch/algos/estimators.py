"""The registered algorithm parts (see ``rlbatch.algos.registry``): thin adapters from the
config to the pure tensor functions of ``rlbatch.algos.core``."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlbatch.algos import core


def grpo(rewards: Tensor, group_size: int, algo: Any) -> Tensor:
    """Group-relative: each reward minus its group's mean, over the group's std (+ adv_eps)."""
    return core.grpo_advantages(rewards, group_size, float(algo.adv_eps))


def ppo_clip(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, algo: Any,
             agg: str) -> tuple[Tensor, core.ClipStats]:
    """PPO's clipped surrogate with separate low/high clip ranges (DAPO's clip-higher)."""
    return core.ppo_clip_loss(logp, old_logp, advantages, mask, float(algo.clip_low), float(algo.clip_high),
                              agg)  # type: ignore[arg-type]


def kl_k1(logp: Tensor, ref: Tensor) -> Tensor:
    return core.kl_penalty(logp, ref, "k1")


def kl_k2(logp: Tensor, ref: Tensor) -> Tensor:
    return core.kl_penalty(logp, ref, "k2")


def kl_k3(logp: Tensor, ref: Tensor) -> Tensor:
    return core.kl_penalty(logp, ref, "k3")


def kl_abs(logp: Tensor, ref: Tensor) -> Tensor:
    return core.kl_penalty(logp, ref, "abs")


def agg_token(per_token: Tensor, mask: Tensor) -> Tensor:
    return core.aggregate(per_token, mask, "token")


def agg_seq(per_token: Tensor, mask: Tensor) -> Tensor:
    return core.aggregate(per_token, mask, "seq")
