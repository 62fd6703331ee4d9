"""The registered algorithm parts (see ``rlbatch.algos.registry``): thin adapters from the
config to the pure tensor functions of ``rlbatch.algos.core``."""

from __future__ import annotations

from functools import partial
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


# The KL estimators and aggregations of core, one registry entry each.
kl_k1 = partial(core.kl_penalty, kind="k1")
kl_k2 = partial(core.kl_penalty, kind="k2")
kl_k3 = partial(core.kl_penalty, kind="k3")
kl_abs = partial(core.kl_penalty, kind="abs")
agg_token = partial(core.aggregate, agg="token")
agg_seq = partial(core.aggregate, agg="seq")
