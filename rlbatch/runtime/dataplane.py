"""The data plane: sample tensors go rank to rank over torch.distributed.

Each rank keeps a ``SampleStore`` of the samples it produced or received. The controller never
sees tokens; it knows only where each (sample, field) lives and how long it is, and tells the
ranks which fields to ``exchange``. Every (source, destination) pair sends one message per
dtype (token ids as int64, per-token values as float32), posted non-blocking on both sides so
the order of pairs cannot deadlock. The receiver sizes its buffers from the lengths the
controller sent. Samples that share fields (a GRPO group's prompt images) share them on the
wire too: a move names, per sample, the sample of the same move whose ``shared`` fields it takes
(``Move.alias``); those go once, and the receiver binds the one tensor to each of them. Message
buffers on both sides come from pools (``BufferPool``) that reuse a buffer once nothing refers to
its memory any more: fresh host memory costs a page fault per page, as much as the copy itself.

Messages are CPU tensors on every rank, whatever its device, so both ends of a pair agree on the
transport: under the "cpu:gloo,cuda:nccl" process group of a GPU job gloo carries them. (Were a
GPU rank to send a CUDA buffer, it would post on NCCL while a CPU worker waits on gloo, and the
two never meet.) Samples are small next to a step's compute, and they live on the CPU anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mpi4py import MPI

INT_FIELDS = frozenset(("prompt", "response", "image_grid_thw"))
"""Sample fields of integers (token ids, an image's patch grid), moved as int64; every other field
is a float tensor."""
CPU = torch.device("cpu")


@dataclass
class Move:
    """Samples (with their per-field lengths) going from ``src`` to ``dst``."""

    src: int
    dst: int
    ids: list[int]
    fields: list[str]
    lengths: list[list[int]]
    """lengths[i][j]: length of fields[j] of ids[i]."""
    shared: list[str] = field(default_factory=list)
    """The fields of ``fields`` that samples of this move may share (a prompt's images)."""
    alias: list[int] = field(default_factory=list)
    """Per sample (empty: every sample sends all its fields), the index in ``ids`` of the sample
    whose ``shared`` fields it takes: its own index (they are sent), or a smaller one whose values
    are equal (not sent; the receiver binds that sample's tensors to this one too)."""

    def __post_init__(self) -> None:
        if self.alias and (len(self.alias) != len(self.ids) or any(not 0 <= a <= i for i, a in enumerate(self.alias))
                           or any(self.alias[a] != a for a in self.alias)):
            raise ValueError(f"move {self.src} -> {self.dst}: alias {self.alias} of {len(self.ids)} samples must name, "
                             f"per sample, itself or an earlier sample that sends its own")
        if self.shared and not set(self.shared) <= set(self.fields):
            raise ValueError(f"move {self.src} -> {self.dst}: shared fields {self.shared} not among {self.fields}")

    def __getstate__(self) -> dict[str, object]:
        """Pickled (the phase command) without the share fields when no sample shares: a text move's
        command is what it was before moves could share."""
        return {k: v for k, v in self.__dict__.items() if v or k not in ("shared", "alias")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update({"shared": [], "alias": []} | state)

    def sends(self, i: int, f: str) -> bool:
        """Whether field ``f`` of ``ids[i]`` is on the wire (not taken from an earlier sample)."""
        return not self.alias or self.alias[i] == i or f not in self.shared

    def size(self, fields: list[str]) -> int:
        """Values of ``fields`` on the wire."""
        idx = [self.fields.index(f) for f in fields]
        if not self.alias:
            return sum(lens[j] for lens in self.lengths for j in idx)
        return sum(lens[j] for i, lens in enumerate(self.lengths) for f, j in zip(fields, idx, strict=True)
                   if self.sends(i, f))

    @property
    def numel(self) -> int:
        return self.size(self.fields)


_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(t: torch.Tensor) -> int:
    """References to t's memory: one per tensor (view or not) on its storage, wherever it is."""
    return int(_USE_COUNT(t.untyped_storage()._cdata)) if _USE_COUNT is not None else -1


class BufferPool:
    """Message buffers reused across exchanges, per (peer, dtype, device).

    Received samples are views into the buffer they arrived in, so a buffer is handed out again
    only when its storage has no reference but the pool's: every sample in it dropped or replaced,
    and no tensor anywhere still viewing it. Data given to callers is never overwritten. A buffer
    too small is replaced by a larger one (grow-only); the pool holds at most as many buffers per
    key as were ever in use at once. Without a use count (a torch that lacks it) nothing is reused.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, torch.dtype, torch.device], list[tuple[torch.Tensor, int]]] = {}

    def take(self, peer: int, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        bufs = self._bufs.setdefault((peer, dtype, device), [])
        free = [k for k, (buf, alone) in enumerate(bufs) if _use_count(buf) == alone != -1]
        fits = [k for k in free if bufs[k][0].numel() >= numel]
        if fits:
            return bufs[min(fits, key=lambda k: bufs[k][0].numel())][0][:numel]
        for k in reversed(free):  # all too small: let them go before allocating a larger one
            del bufs[k]
        buf = torch.empty(numel, dtype=dtype, device=device)
        bufs.append((buf, _use_count(buf)))
        return buf


@dataclass
class SampleStore:
    """This rank's samples: id -> field -> 1-D tensor (CPU), and the buffers they arrived in."""

    samples: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    recv_pool: BufferPool = field(default_factory=BufferPool)
    send_pool: BufferPool = field(default_factory=BufferPool)

    def put(self, sid: int, name: str, value: torch.Tensor) -> None:
        self.samples.setdefault(sid, {})[name] = value

    def get(self, ids: list[int], fields: list[str]) -> list[dict[str, torch.Tensor]]:
        return [{f: self.samples[i][f] for f in fields if f in self.samples[i]} for i in ids]

    def drop(self, ids: list[int]) -> None:
        for i in ids:
            self.samples.pop(i, None)


def _parts(m: Move) -> list[tuple[torch.dtype, list[str]]]:
    """A move sends up to two buffers: token ids as int64, per-token values as float32."""
    ints = [f for f in m.fields if f in INT_FIELDS]
    floats = [f for f in m.fields if f not in INT_FIELDS]
    return [(dt, fs) for dt, fs in ((torch.long, ints), (torch.float32, floats)) if fs]


def _pack(store: SampleStore, m: Move, dtype: torch.dtype, fields: list[str]) -> torch.Tensor:
    parts = [store.samples[sid][f].reshape(-1).to(CPU, dtype) for i, sid in enumerate(m.ids) for f in fields
             if m.sends(i, f)]
    if not parts:
        return torch.empty(0, dtype=dtype)
    if len(parts) == 1:
        return parts[0].contiguous()  # one tensor: send it as it is, no copy
    return torch.cat(parts, out=store.send_pool.take(m.dst, dtype, CPU, sum(p.numel() for p in parts)))


def _unpack(store: SampleStore, m: Move, fields: list[str], flat: torch.Tensor) -> None:
    from rlbatch.runtime.mpi_dataplane import unpack

    unpack(store, m, fields, flat, lambda view: view)


@dataclass
class Traffic:
    """What ``exchange`` of some moves sends rank to rank, counted where the moves are made: one
    message per dtype part of a move between two ranks (``_parts``), and its bytes (shared fields
    once per move, ``Move.alias``)."""

    messages: int = 0
    bytes: int = 0

    def add(self, moves: list[Move]) -> None:
        for m in moves:
            if m.src == m.dst:
                continue
            for dtype, fields in _parts(m):
                self.messages += 1
                self.bytes += m.size(fields) * torch.empty(0, dtype=dtype).element_size()


def exchange(store: SampleStore, rank: int, moves: list[Move], comm: MPI.Comm | None = None,
             timeout_s: float = 600.0) -> dict[str, float]:
    """Do this rank's part of ``moves``: post every send and receive (CPU buffers), then wait for all.
    ``comm``: the world's MPI transport (``World.data_comm``) in a run with no torch.distributed
    world; the same messages go over MPI (``rlbatch.runtime.mpi_dataplane``), waited for at most
    ``timeout_s``, and arrive as tensors viewing their message's buffer, as here."""
    if comm is not None:
        from rlbatch.runtime import mpi_dataplane

        return mpi_dataplane.exchange(store, rank, moves, comm, torch.from_numpy, timeout_s)
    start = time.perf_counter()
    reqs, inbox = [], []
    sent = received = 0
    for m in moves:
        if rank not in (m.src, m.dst) or m.src == m.dst:
            continue
        for dtype, fields in _parts(m):
            if m.src == rank:
                buf = _pack(store, m, dtype, fields)
                reqs.append(dist.isend(buf, dst=m.dst))
                sent += buf.numel() * buf.element_size()
            else:
                buf = store.recv_pool.take(m.src, dtype, CPU, m.size(fields))
                reqs.append(dist.irecv(buf, src=m.src))
                inbox.append((m, fields, buf))
    for r in reqs:
        if r is not None:
            r.wait()
    for m, fields, buf in inbox:
        _unpack(store, m, fields, buf)
        received += buf.numel() * buf.element_size()
    return {"bytes_sent": float(sent), "bytes_received": float(received), "seconds": time.perf_counter() - start}
