"""Off-policy corrections: what the loss does about samples the inference engine generated with
older weights than the trainer's (``algo.max_staleness > 0``), or with a slightly different
numerical path (another engine, another precision) at any staleness.

Each correction maps the per-token importance ratio of the policy before this step's updates to
the behaviour policy that sampled the tokens, ``r_t = exp(old_logp_t - behaviour_logp_t)``, to a
per-token weight on the policy loss and a keep mask (1 keeps the token in the loss and in its
token count). ``behaviour_logp_t`` is the log-prob the inference engine returned with token t,
under the weights that sampled it: with weights loaded mid-generation (``algo.in_flight_updates``)
the tokens of one sample carry different behaviour policies, and each is corrected by its own.
The clipped PPO ratio is then taken against the old policy as usual (the decoupled objective:
the proximal policy is the trainer's, the weight corrects for the sampler).

    none      weight 1, every token kept (the behaviour log-probs are not read)
    tis       truncated importance sampling: weight min(r_t, algo.tis_cap), every token kept
    mask      weight 1, tokens with r_t outside [algo.mask_ratio_low, algo.mask_ratio_high] dropped
    seq_tis   every token of a sequence weighs min(s, algo.seq_tis_cap), s the sequence's
              geometric-mean ratio exp(mean_t log r_t) over its response tokens
    seq_mask  weight 1, a sequence whose s lies outside [algo.seq_mask_low, algo.seq_mask_high]
              leaves the loss whole

A weight multiplies the token's advantage: for w >= 0, min(r A w, clip(r) A w) = w min(r A, clip(r) A),
so every registered policy loss takes it without knowing about it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlbatch.config.schema import AlgoConfig

_MAX_LOG_RATIO = 20.0
"""|log r_t| is clamped here: exp() of more overflows float32 (or underflows to 0, whose log is -inf)."""

QUANTILES = (0.05, 0.5, 0.95)
"""The ratio quantiles logged (``offpolicy/ratio_p05``, ``_p50``, ``_p95``)."""


def importance_ratio(old_logp: Tensor, behaviour_logp: Tensor) -> Tensor:
    """Per-token ratio of the old policy to the behaviour policy (detached; float32)."""
    log_ratio = (old_logp.detach().float() - behaviour_logp.float()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio)


def sequence_ratio(ratio: Tensor, mask: Tensor) -> Tensor:
    """``[B, 1]``: each row's geometric-mean ratio ``exp(mean_t log r_t)`` over its masked tokens
    (1 for a row with none): the length-normalised likelihood ratio of the whole sequence."""
    on = mask.to(ratio.dtype)
    log_mean = (ratio.log() * on).sum(-1, keepdim=True) / on.sum(-1, keepdim=True).clamp(min=1.0)
    return torch.exp(log_mean)


def no_correction(ratio: Tensor, mask: Tensor, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    return torch.ones_like(ratio), torch.ones_like(ratio)


def truncated_is(ratio: Tensor, mask: Tensor, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    """TIS: the ratio capped at ``algo.tis_cap`` from above."""
    return ratio.clamp(max=float(algo.tis_cap)), torch.ones_like(ratio)


def ratio_mask(ratio: Tensor, mask: Tensor, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    """Tokens whose ratio lies outside [mask_ratio_low, mask_ratio_high] leave the loss."""
    keep = (ratio >= float(algo.mask_ratio_low)) & (ratio <= float(algo.mask_ratio_high))
    return torch.ones_like(ratio), keep.to(ratio.dtype)


def seq_truncated_is(ratio: Tensor, mask: Tensor, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    """Sequence-level TIS: every token of a row weighs its geometric-mean ratio, capped at
    ``algo.seq_tis_cap``."""
    weight = sequence_ratio(ratio, mask).clamp(max=float(algo.seq_tis_cap))
    return weight.expand_as(ratio).clone(), torch.ones_like(ratio)


def seq_ratio_mask(ratio: Tensor, mask: Tensor, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    """A row whose geometric-mean ratio lies outside [seq_mask_low, seq_mask_high] leaves the loss
    whole (every token of it, in the loss and in the count)."""
    s = sequence_ratio(ratio, mask)
    keep = (s >= float(algo.seq_mask_low)) & (s <= float(algo.seq_mask_high))
    return torch.ones_like(ratio), keep.to(ratio.dtype).expand_as(ratio).clone()


def ratio_stats(ratio: Tensor, weight: Tensor, keep: Tensor, mask: Tensor, sequence: bool = False) -> dict[str, float]:
    """The correction's statistics over a micro-batch's response tokens, and the train/inference
    mismatch: the k3 estimate of KL(behaviour || old) (``r - log r - 1`` per token, never negative)
    and the ratio's quantiles. Means and fractions, so the engine's weighted sum over micro-batches
    stays a mean; a quantile is the micro-batch's, averaged over micro-batches the same way.
    ``sequence``: the correction weighs sequences (``SEQUENCE_CORRECTIONS``), so a token counts as
    truncated when its weight is below its sequence's ratio rather than its own."""
    n = mask.sum().clamp(min=1.0)
    on = mask > 0
    log_ratio = ratio.log()
    corrected = sequence_ratio(ratio, mask).expand_as(ratio) if sequence else ratio
    out = {
        "offpolicy/ratio_mean": float((ratio * mask).sum() / n),
        "offpolicy/abs_log_ratio_mean": float((log_ratio.abs() * mask).sum() / n),
        "offpolicy/k3_kl": float(((ratio - log_ratio - 1.0) * mask).sum() / n),
        "offpolicy/weight_mean": float((weight * mask).sum() / n),
        "offpolicy/truncated_frac": float(((weight < corrected) & on).sum() / n),
        "offpolicy/masked_frac": float(((keep == 0) & on).sum() / n),
    }
    values = ratio[on].float()
    qs = torch.quantile(values, torch.tensor(QUANTILES)) if values.numel() else torch.ones(len(QUANTILES))
    for q, v in zip(QUANTILES, qs.tolist(), strict=True):
        out[f"offpolicy/ratio_p{round(q * 100):02d}"] = float(v)
    return out
