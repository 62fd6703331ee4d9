"""Ulysses context parallelism: a packed row's tokens split over the ranks of a ``cp`` group.

Each rank of the group holds one contiguous slice of the row (``local``) and runs the model on it;
only attention needs the whole sequence. Around it, one all-to-all turns the sequence-split
queries, keys and values into head-split ones ([1, H, S/c, D] -> [1, H/c, S, D]), attention runs
over the full sequence for H/c heads, and a second all-to-all turns the output back ([1, S/c, H, D]
on each rank). Every other layer is per-token, so it needs no communication. This is DeepSpeed
Ulysses, as verl and AReaL apply it to FSDP models.

The model is switched with ``use(model)`` (transformers' attention interface, name ``ULYSSES``);
a forward runs inside ``over(group, position_ids)``, which gives attention the group and the
row's full position ids: a packed row's samples are found from them (a sample starts where its
position is 0) and attention stays inside each sample, causal, as in an unsplit packed row.
Key/value heads fewer than the group are repeated up to it first (grouped-query models).

Gradients: the all-to-alls carry them back to each rank's slice, so a rank's parameter gradients
are those of its own tokens' loss; the group's ranks sum theirs (an all-reduce over ``cp``, or
FSDP over ranks that include the group, with the loss scaled by c).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from rlbatch.engines import attention

if TYPE_CHECKING:
    from rlbatch.engines.batch import Flat

ULYSSES = "rlbatch_ulysses"


class _AllToAllCtx(Protocol):
    """What ``_AllToAll``'s forward keeps on autograd's context for its backward."""

    group: dist.ProcessGroup
    scatter: int
    gather: int


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into ``c`` chunks along ``scatter``, exchange them, concatenate what arrives
    along ``gather``; backward is the same exchange the other way round."""

    @staticmethod
    def forward(ctx: _AllToAllCtx, x: torch.Tensor, group: dist.ProcessGroup, scatter: int,
                gather: int) -> torch.Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx: _AllToAllCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int) -> torch.Tensor:
    c = dist.get_world_size(group)
    chunks = [t.contiguous() for t in x.chunk(c, dim=scatter)]
    received = [torch.empty_like(t) for t in chunks]
    dist.all_to_all(received, chunks, group=group)
    return torch.cat(received, dim=gather)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter: int = 1, gather: int = 2) -> torch.Tensor:
    """Dim ``scatter`` split over the group, what arrives concatenated along dim ``gather``,
    differentiable. On attention's inputs, [B, H, S/c, D] on each rank -> [B, H/c, S, D] (rank r gets
    heads r*H/c .. (r+1)*H/c - 1); on its output, the way back: [B, S, H/c, D] -> [B, S/c, H, D]."""
    return _AllToAll.apply(x, group, scatter, gather)


class _GatherCtx(Protocol):
    """What ``_Gather``'s forward keeps on autograd's context for its backward."""

    group: dist.ProcessGroup
    dim: int
    size: int


class _Gather(torch.autograd.Function):
    """All-gather of the group's slices along ``dim``; backward keeps this rank's slice of the
    gradient (every rank computes the same function of the whole)."""

    @staticmethod
    def forward(ctx: _GatherCtx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.size = group, dim, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: _GatherCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        rank = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, rank * ctx.size, ctx.size), None, None


def gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The whole sequence from each rank's slice (``local``'s inverse), differentiable."""
    return _Gather.apply(x, group, dim)


def padded_length(n: int, c: int) -> int:
    """A row's length rounded up to a multiple of the group's size (each rank an equal slice)."""
    return -(-n // c) * c


def local(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (its length a multiple of the group's size)."""
    c, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[dim]
    if n % c:
        raise ValueError(f"a row of {n} tokens does not split over {c} context-parallel ranks; pad it to "
                         f"{padded_length(n, c)} first (padded_length)")
    return x.narrow(dim, rank * (n // c), n // c)


@dataclass
class _Active:
    group: dist.ProcessGroup
    position_ids: torch.Tensor  # [1, S]: the whole row's


_ACTIVE: list[_Active] = []


@contextmanager
def over(group: dist.ProcessGroup, position_ids: torch.Tensor) -> Iterator[None]:
    """Run the forwards inside split over ``group``; ``position_ids`` [1, S] is the whole row's."""
    _ACTIVE.append(_Active(group, position_ids))
    try:
        yield
    finally:
        _ACTIVE.pop()


def _boundaries(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sample lengths of a packed row (int32, [samples + 1]): a sample starts at position 0."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)


def _block_causal(position_ids: torch.Tensor) -> torch.Tensor:
    """[S, S] bool: causal attention inside each sample of the row."""
    pos = position_ids.reshape(-1)
    segment = torch.cumsum((pos == 0).to(torch.int64), 0)
    causal = torch.ones(pos.numel(), pos.numel(), dtype=torch.bool, device=pos.device).tril()
    return causal & (segment[:, None] == segment[None, :])


def split_heads(hq: int, key: torch.Tensor, value: torch.Tensor, c: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` with their heads (along ``dim``) ready for ``hq`` query heads split over c
    ranks: as they are, or (grouped-query, fewer than c or not a multiple of it) each head repeated so
    that the group splits them evenly, every query head keeping its own. Raises where they cannot split."""
    hkv = key.shape[dim]
    if hq % c:
        raise ValueError(f"{hq} attention heads do not split over {c} context-parallel ranks")
    if hkv % c:
        if c % hkv:
            raise ValueError(f"{hkv} key/value heads cannot be repeated to a multiple of {c} context-parallel ranks")
        key, value = (t.repeat_interleave(c // hkv, dim=dim) for t in (key, value))
    return key, value


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature on this rank's slice: ``query`` [1, Hq, S/c, D],
    ``key``/``value`` [1, Hkv, S/c, D] -> ([1, S/c, Hq, D], None)."""
    if not _ACTIVE:
        raise RuntimeError(f"{ULYSSES} attention outside ulysses.over(group, position_ids)")
    if dropout:
        raise NotImplementedError(f"attention dropout {dropout} under context parallelism; set the model's "
                                  "attention_dropout to 0")
    if sliding_window is not None:
        raise NotImplementedError(f"sliding-window attention ({sliding_window} tokens) under context parallelism")
    active = _ACTIVE[-1]
    group = active.group
    key, value = split_heads(query.shape[1], key, value, dist.get_world_size(group), dim=1)
    q, k, v = (all_to_all(t, group) for t in (query, key, value))  # [1, H/c, S, D]
    if attention.available(q.device, q.dtype):  # the sample boundaries, no mask
        cu = _boundaries(active.position_ids).to(q.device)
        m = int((cu[1:] - cu[:-1]).max())
        out, _ = attention.varlen_attention(module, q, k, v, None, scaling=scaling, cu_seq_lens_q=cu,
                                            cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)
    else:
        mask = _block_causal(active.position_ids.to(q.device))
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        out = out.transpose(1, 2)  # [1, S, H/c, D]
    return all_to_all(out.contiguous(), group), None  # [1, S/c, H, D]


def register() -> None:
    """Make ``ULYSSES`` a transformers attention implementation (idempotent); it builds its own
    mask from the row's position ids, so transformers gives it none."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES, lambda **kwargs: None)


def use(model: torch.nn.Module) -> None:
    """Switch ``model`` (a transformers model, possibly wrapped) to Ulysses attention."""
    config = getattr(getattr(model, "module", model), "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no transformers config to select its attention with")
    register()
    config._attn_implementation = ULYSSES


class _SumAcross(torch.autograd.Function):
    """All-reduce (sum) whose backward passes the gradient through unchanged: every rank computes
    the same function of the sum, and each rank's addend is its own positions only."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@dataclass
class Slice:
    """What a rank's slice of a split ``Flat`` row needs beside its own tokens (``Flat.cp``)."""

    group: dist.ProcessGroup
    position_ids: torch.Tensor  # [1, S] the whole (padded) row's

    def over(self) -> AbstractContextManager[None]:
        return over(self.group, self.position_ids)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return _SumAcross.apply(x, self.group)


def split(x: Flat, group: dist.ProcessGroup) -> Flat:
    """This rank's slice of the packed row ``x``: the row padded to a multiple of the group's size
    (the padding is one more run of positions 0, 1, ..., read by nobody), its contiguous share of
    the tokens, and of ``keep``/``where`` the positions that fall in it (``keep`` relative to the
    slice). Outputs kept on each rank are summed over the group by ``batch.spread``."""
    c, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.input_ids.shape[1]
    pad = padded_length(max(n, 1), c) - n
    ids = torch.cat([x.input_ids, x.input_ids.new_zeros(1, pad)], 1)
    positions = torch.cat([x.position_ids, torch.arange(pad, device=x.position_ids.device)[None]], 1)
    size = ids.shape[1] // c
    mine = (x.keep >= rank * size) & (x.keep < (rank + 1) * size)
    return replace(x, input_ids=local(ids, group), position_ids=local(positions, group),
                   keep=x.keep[mine] - rank * size, where=x.where[mine], cp=Slice(group, positions))
