"""Pure tensor functions for policy-gradient RL on token sequences (GRPO / PPO).

Nothing here holds state or touches globals: every function maps tensors to tensors, so the
trainer, the tests and any other backend can share them. Shapes use ``B`` for sequences,
``T`` for completion tokens and ``V`` for the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

KLKind = Literal["k1", "k2", "k3", "abs"]
LossAgg = Literal["token", "seq", "seq_sum"]
Aggregator = LossAgg | Callable[[Tensor, Tensor], Tensor]

# exp() of a log-ratio above this overflows float32 long before it carries information; clamping
# keeps one badly off-policy token from turning the whole loss into inf/nan.
_MAX_LOG_RATIO = 20.0
# k3 grows like exp(ref_logp - logp): one sampled token the policy has since made very unlikely
# can outweigh the whole batch (seen in the prototype as a KL spike then a reward crash). Capping
# it (as veRL's low_var_kl does) zeroes that token's gradient instead.
_MAX_K3 = 10.0


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is true (or nonzero).

    With ``dim=None`` the mean is over every masked element; otherwise along ``dim``. A slice
    with no masked element yields 0, not nan, so an all-padding row cannot poison a batch.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1.0)


def aggregate(per_token: Tensor, mask: Tensor, agg: LossAgg = "token", norm: float | None = None) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    ``"token"`` averages over all valid tokens of the batch, so long completions weigh more
    (DAPO style). ``"seq"`` averages inside each sequence first and then over the sequences
    that have at least one valid token, so every sequence weighs the same (original GRPO).
    ``"seq_sum"`` sums each sequence's tokens and divides by the constant ``norm`` (Dr.GRPO uses
    the longest possible response), then averages over the ``B`` sequences: no length bias either
    way, since a token's weight never depends on the length of its sequence.
    """
    if agg == "token":
        return masked_mean(per_token, mask)
    if agg == "seq":
        per_seq = masked_mean(per_token, mask, dim=-1)
        has_tokens = (mask.sum(-1) > 0).to(per_token.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    if agg == "seq_sum":
        if norm is None or norm <= 0:
            raise ValueError(f"loss aggregation 'seq_sum' needs a positive constant norm, got {norm}")
        return (per_token * mask.to(per_token.dtype)).sum() / (norm * max(per_token.shape[0], 1))
    raise ValueError(f"unknown loss aggregation {agg!r}; expected 'token', 'seq' or 'seq_sum'")


def aggregate_total(per_token: Tensor, mask: Tensor, agg: LossAgg = "token", norm: float | None = None) -> Tensor:
    """The numerator of ``aggregate``: a sum over rows, so the totals of any split of the rows add
    up to the whole batch's. ``aggregate_total / aggregate_count`` is ``aggregate`` (to rounding)
    whenever the count is positive; dividing the totals of micro-batches by the count of the whole
    mini-batch (``aggregate_count`` summed over them) gives the unsplit batch's loss and gradient."""
    if agg == "token":
        return (per_token * mask.to(per_token.dtype)).sum()
    if agg == "seq":
        has_tokens = (mask.sum(-1) > 0).to(per_token.dtype)
        return (masked_mean(per_token, mask, dim=-1) * has_tokens).sum()
    if agg == "seq_sum":
        if norm is None or norm <= 0:
            raise ValueError(f"loss aggregation 'seq_sum' needs a positive constant norm, got {norm}")
        return (per_token * mask.to(per_token.dtype)).sum() / norm
    raise ValueError(f"unknown loss aggregation {agg!r}; expected 'token', 'seq' or 'seq_sum'")


def aggregate_count(mask: Tensor, agg: LossAgg = "token") -> Tensor:
    """The denominator of ``aggregate`` for the rows of ``mask`` ``[B, T]``, additive over rows:
    ``"token"`` the valid tokens, ``"seq"`` the sequences with at least one, ``"seq_sum"`` every
    sequence (its constant norm is in ``aggregate_total``)."""
    if agg == "token":
        return mask.to(torch.float64).sum()
    if agg == "seq":
        return (mask.sum(-1) > 0).to(torch.float64).sum()
    if agg == "seq_sum":
        return torch.tensor(float(mask.shape[0]), dtype=torch.float64)
    raise ValueError(f"unknown loss aggregation {agg!r}; expected 'token', 'seq' or 'seq_sum'")


def _reduce(per_token: Tensor, mask: Tensor, agg: Aggregator) -> Tensor:
    return agg(per_token, mask) if callable(agg) else aggregate(per_token, mask, agg)


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, std_normalize: bool = True) -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally over its std.

    ``rewards`` is ``[N]`` with the ``group_size`` samples of one prompt adjacent. The std is
    the unbiased one (as in DeepSeekMath and TRL). A group whose rewards are all equal gets
    zero advantage: it carries no signal about which sample was better.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.view(-1)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    ``k1`` is ``logp - ref_logp`` (unbiased, can be negative); ``k2`` is half its square;
    ``k3`` is ``exp(r) - r - 1`` with ``r = ref_logp - logp`` (unbiased and never negative,
    Schulman's estimator used by GRPO), capped at 10 per token; ``abs`` is ``|logp - ref_logp|``.
    """
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        r = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(r) - r - 1.0).clamp(max=_MAX_K3)
    if kind == "abs":
        return diff.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of k1, k2, k3, abs")


@dataclass(frozen=True)
class ClipStats:
    """Diagnostics of one clipped policy-gradient loss; 0-d detached tensors (no host sync).

    ``clip_frac`` is the share of valid tokens whose gradient the clip removed, split into
    ``clip_frac_low`` (ratio below ``1 - clip_low`` with negative advantage) and
    ``clip_frac_high`` (ratio above ``1 + clip_high`` with positive advantage).
    ``approx_kl`` is the k3 estimate of KL(old || new) over valid tokens.
    """

    clip_frac: Tensor
    clip_frac_low: Tensor
    clip_frac_high: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: Aggregator = "token",
) -> tuple[Tensor, ClipStats]:
    """PPO clipped surrogate loss (to minimise) with separate lower/upper clip ranges.

    ``logp``/``old_logp``/``mask`` are ``[B, T]``; ``advantages`` is ``[B]`` (one per
    sequence, broadcast over its tokens) or ``[B, T]``. Per token the loss is
    ``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``; a larger
    ``clip_high`` lets rare good tokens grow faster (DAPO's clip-higher).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _clipped_surrogate(torch.exp(log_ratio), logp, old_logp, advantages, mask, clip_low, clip_high, agg)


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: Aggregator = "seq",
) -> tuple[Tensor, ClipStats]:
    """GSPO: the clipped surrogate with one importance ratio per sequence.

    The sequence ratio is ``s_i = exp(mean_t(logp - old_logp))`` over the sequence's valid tokens
    (the length-normalised likelihood ratio), and the clip acts on it, so a sequence is kept or
    clipped as a whole. Per token the ratio is ``sg[s_i] * exp(logp_t - sg[logp_t])`` (GSPO-token):
    equal to ``s_i`` in value, with the gradient ``s_i * grad logp_t``; averaged per sequence
    (``agg='seq'``) that is GSPO's gradient, and per-token advantages still work. Its clip ranges
    are in units of a per-token-averaged ratio, hence far smaller than PPO's (3e-4 / 4e-4).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    seq_log_ratio = masked_mean(logp.detach() - old_logp, mask, dim=-1).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(seq_log_ratio[:, None] + logp - logp.detach())
    return _clipped_surrogate(ratio, logp, old_logp, advantages, mask, clip_low, clip_high, agg)


def _clipped_surrogate(ratio: Tensor, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                       clip_low: float, clip_high: float, agg: Aggregator) -> tuple[Tensor, ClipStats]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = _reduce(torch.maximum(unclipped, clipped), mask, agg)

    with torch.no_grad():
        was_clipped = (clipped > unclipped).to(logp.dtype)
        low = was_clipped * (ratio < 1.0 - clip_low).to(logp.dtype)
        high = was_clipped * (ratio > 1.0 + clip_high).to(logp.dtype)
        stats = ClipStats(
            clip_frac=masked_mean(was_clipped, mask),
            clip_frac_low=masked_mean(low, mask),
            clip_frac_high=masked_mean(high, mask),
            approx_kl=masked_mean(kl_penalty(old_logp, logp, "k3"), mask),
            ratio_mean=masked_mean(ratio, mask),
        )
    return loss, stats


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """Log-probability of each target token: ``logits[..., target] - logsumexp(logits)``.

    ``logits`` is ``[..., V]`` and ``targets`` ``[...]``. Gathering one logit and subtracting
    the log-normaliser never materialises a second ``[..., V]`` tensor the way
    ``log_softmax(...).gather(...)`` does, which matters at real vocabulary sizes. Low
    precision logits are upcast because logsumexp in bf16 loses the small differences that
    PPO ratios are made of.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position of ``[..., V]`` logits."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


@torch.no_grad()
def entropy_for_stats(logits: Tensor, rows: int = 1024) -> Tensor:
    """``entropy_from_logits`` without a graph, ``rows`` positions at a time: the per-step entropy
    metric costs at most ``rows x V`` floats of scratch, whatever the batch."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.cat([entropy_from_logits(flat[i : i + rows]) for i in range(0, flat.shape[0], rows)]) \
        if flat.shape[0] else flat.new_zeros(0)
    return out.reshape(logits.shape[:-1])


CHUNK_BYTES = 1 << 28
"""``chunked_logprobs`` upcasts this many bytes of fp32 logits at a time (256 MiB: ~440 rows of a
151936-token vocabulary)."""


class _ChunkedLogProbs(torch.autograd.Function):
    """Log-prob of each target and optionally the entropy, ``rows`` logits rows at a time in fp32.
    Saves only the logits as given (bf16 on a GPU) and one fp32 number or two per row; the backward
    recomputes each chunk's softmax from the saved log-normaliser."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, rows: int, entropy: bool) -> tuple[Tensor, Tensor]:
        K = logits.shape[0]
        logp = torch.empty(K, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if entropy else logp.new_zeros(0)
        for i in range(0, K, rows):
            x = logits[i : i + rows].float()
            lse[i : i + rows] = torch.logsumexp(x, dim=-1)
            logp[i : i + rows] = x.gather(-1, targets[i : i + rows, None]).squeeze(-1) - lse[i : i + rows]
            if entropy:
                ent[i : i + rows] = lse[i : i + rows] - (torch.softmax(x, dim=-1) * x).sum(-1)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.rows, ctx.entropy = rows, entropy
        if not entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor, g_ent: Tensor) -> tuple[Tensor, None, None, None]:
        logits, targets, lse, ent = ctx.saved_tensors
        rows = ctx.rows
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], rows):
            x = logits[i : i + rows].float()
            p = torch.exp(x - lse[i : i + rows, None])
            gl = g_logp[i : i + rows, None]
            # d logp_t / dx = onehot(t) - p;  d H / dx = -p * (x - E_p[x]),  E_p[x] = lse - H
            g = -p * gl
            if ctx.entropy:
                g -= p * (x - (lse[i : i + rows] - ent[i : i + rows])[:, None]) * g_ent[i : i + rows, None]
            g.scatter_add_(-1, targets[i : i + rows, None], gl)
            grad[i : i + rows] = g.to(grad.dtype)
        return grad, None, None, None


def chunked_logprobs(logits: Tensor, targets: Tensor, entropy: bool = False,
                     chunk_bytes: int = CHUNK_BYTES) -> tuple[Tensor, Tensor | None]:
    """(log-prob of each target, entropy or None) of ``[K, V]`` logits, both ``[K]`` fp32.

    The numbers of ``token_logprobs`` and ``entropy_from_logits`` (logsumexp and softmax in fp32),
    computed ``chunk_bytes`` of fp32 logits at a time, forward and backward: the graph keeps the
    logits as given and ``[K]`` floats, never an fp32 ``[K, V]`` copy, a softmax or its product
    (``token_logprobs`` keeps the fp32 copy for its logsumexp; the entropy of full logits keeps
    three such tensors)."""
    rows = max(1, chunk_bytes // (4 * max(logits.shape[-1], 1)))
    logp, ent = _ChunkedLogProbs.apply(logits, targets, rows, entropy)
    return logp, ent if entropy else None
