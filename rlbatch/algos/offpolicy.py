"""Off-policy corrections: what the loss does about samples the inference engine generated with
older weights than the trainer's (``algo.max_staleness > 0``), or with a slightly different
numerical path (another engine, another precision) at any staleness.

Each correction maps the per-token importance ratio of the policy before this step's updates to
the behaviour policy that sampled the tokens, ``r_t = exp(old_logp_t - behaviour_logp_t)``, to a
per-token weight on the policy loss and a keep mask (1 keeps the token in the loss and in its
token count). The clipped PPO ratio is then taken against the old policy as usual (the decoupled
objective: the proximal policy is the trainer's, the weight corrects for the sampler).

    none      weight 1, every token kept (the behaviour log-probs are not read)
    tis       truncated importance sampling: weight min(r_t, algo.tis_cap), every token kept
    mask      weight 1, tokens with r_t outside [algo.mask_ratio_low, algo.mask_ratio_high] dropped

A weight multiplies the token's advantage: for w >= 0, min(r A w, clip(r) A w) = w min(r A, clip(r) A),
so every registered policy loss takes it without knowing about it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlbatch.config.schema import AlgoConfig


def importance_ratio(old_logp: Tensor, behaviour_logp: Tensor) -> Tensor:
    """Per-token ratio of the old policy to the behaviour policy (detached; float32)."""
    return torch.exp((old_logp.detach().float() - behaviour_logp.float()).clamp(max=20.0))


def no_correction(ratio: Tensor, mask: Tensor, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    return torch.ones_like(ratio), torch.ones_like(ratio)


def truncated_is(ratio: Tensor, mask: Tensor, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    """TIS: the ratio capped at ``algo.tis_cap`` from above."""
    return ratio.clamp(max=float(algo.tis_cap)), torch.ones_like(ratio)


def ratio_mask(ratio: Tensor, mask: Tensor, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    """Tokens whose ratio lies outside [mask_ratio_low, mask_ratio_high] leave the loss."""
    keep = (ratio >= float(algo.mask_ratio_low)) & (ratio <= float(algo.mask_ratio_high))
    return torch.ones_like(ratio), keep.to(ratio.dtype)


def ratio_stats(ratio: Tensor, weight: Tensor, keep: Tensor, mask: Tensor) -> dict[str, float]:
    """The correction's statistics over a micro-batch's response tokens (means and fractions, so
    the engine's weighted sum over micro-batches stays a mean)."""
    n = mask.sum().clamp(min=1.0)
    on = mask > 0
    return {
        "offpolicy/ratio_mean": float((ratio * mask).sum() / n),
        "offpolicy/abs_log_ratio_mean": float((ratio.log().abs() * mask).sum() / n),
        "offpolicy/weight_mean": float((weight * mask).sum() / n),
        "offpolicy/truncated_frac": float(((weight < ratio) & on).sum() / n),
        "offpolicy/masked_frac": float(((keep == 0) & on).sum() / n),
    }
