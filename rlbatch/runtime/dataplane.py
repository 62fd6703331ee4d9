"""The data plane: sample tensors go rank to rank over torch.distributed.

Each rank keeps a ``SampleStore`` of the samples it produced or received. The controller never
sees tokens; it knows only where each (sample, field) lives and how long it is, and tells the
ranks which fields to ``exchange``. Every (source, destination) pair sends one message per
dtype (token ids as int64, per-token values as float32), posted non-blocking on both sides so
the order of pairs cannot deadlock. The receiver allocates from the lengths the controller sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

TOKEN_FIELDS = ("prompt", "response")
INT_FIELDS = frozenset(TOKEN_FIELDS)


@dataclass
class Move:
    """Samples (with their per-field lengths) going from ``src`` to ``dst``."""

    src: int
    dst: int
    ids: list[int]
    fields: list[str]
    lengths: list[list[int]]
    """lengths[i][j]: length of fields[j] of ids[i]."""

    @property
    def numel(self) -> int:
        return sum(sum(x) for x in self.lengths)


@dataclass
class SampleStore:
    """This rank's samples: id -> field -> 1-D tensor (CPU)."""

    samples: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

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


def _size(m: Move, fields: list[str]) -> int:
    idx = [m.fields.index(f) for f in fields]
    return sum(lens[j] for lens in m.lengths for j in idx)


def _pack(store: SampleStore, m: Move, dtype: torch.dtype, fields: list[str]) -> torch.Tensor:
    parts = [store.samples[i][f].reshape(-1).to(dtype) for i in m.ids for f in fields]
    if len(parts) == 1:
        return parts[0].contiguous()  # one tensor: send it as it is, no copy
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def _unpack(store: SampleStore, m: Move, fields: list[str], flat: torch.Tensor) -> None:
    idx = [m.fields.index(f) for f in fields]
    pos = 0
    for i, lens in zip(m.ids, m.lengths, strict=True):
        for f, j in zip(fields, idx, strict=True):
            store.put(i, f, flat[pos : pos + lens[j]])  # a view into the received buffer
            pos += lens[j]


def exchange(store: SampleStore, rank: int, moves: list[Move], device: torch.device | None = None) -> dict[str, float]:
    """Do this rank's part of ``moves``: post every send and receive, then wait for all.

    ``device`` is where message buffers live (a GPU for NCCL); samples stay on the CPU.
    """
    start = time.perf_counter()
    dev = device or torch.device("cpu")
    reqs, inbox = [], []
    sent = received = 0
    for m in moves:
        if rank not in (m.src, m.dst) or m.src == m.dst:
            continue
        for dtype, fields in _parts(m):
            if m.src == rank:
                buf = _pack(store, m, dtype, fields).to(dev)
                reqs.append(dist.isend(buf, dst=m.dst))
                sent += buf.numel() * buf.element_size()
            else:
                buf = torch.empty(_size(m, fields), dtype=dtype, device=dev)
                reqs.append(dist.irecv(buf, src=m.src))
                inbox.append((m, fields, buf))
    for r in reqs:
        if r is not None:
            r.wait()
    for m, fields, buf in inbox:
        _unpack(store, m, fields, buf.cpu())
        received += buf.numel() * buf.element_size()
    return {"bytes_sent": float(sent), "bytes_received": float(received), "seconds": time.perf_counter() - start}
