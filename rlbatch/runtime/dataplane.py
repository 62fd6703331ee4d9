"""The data plane: sample tensors go rank to rank over torch.distributed.

Each rank keeps a ``SampleStore`` of the samples it produced or received. The controller never
sees tokens; it knows only where each (sample, field) lives and how long it is, and tells the
ranks which fields to ``exchange``. Every (source, destination) pair sends one packed float64
message (token ids are exact in float64), posted non-blocking on both sides so the order of
pairs cannot deadlock. The receiver allocates from the lengths the controller sent along.
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


def _pack(store: SampleStore, m: Move) -> torch.Tensor:
    parts = [store.samples[i][f].to(torch.float64).reshape(-1) for i in m.ids for f in m.fields]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)


def _unpack(store: SampleStore, m: Move, flat: torch.Tensor) -> None:
    pos = 0
    for i, lens in zip(m.ids, m.lengths, strict=True):
        for f, n in zip(m.fields, lens, strict=True):
            t = flat[pos : pos + n]
            store.put(i, f, t.to(torch.long) if f in INT_FIELDS else t.to(torch.float32))
            pos += n


def exchange(store: SampleStore, rank: int, moves: list[Move], device: torch.device | None = None) -> dict[str, float]:
    """Do this rank's part of ``moves``: post every send and receive, then wait for all.

    ``device`` is where message buffers live (a GPU for NCCL); samples stay on the CPU.
    """
    start = time.perf_counter()
    dev = device or torch.device("cpu")
    reqs, inbox = [], []
    sent = received = 0
    for m in moves:
        if m.src == rank and m.dst != rank and m.numel:
            buf = _pack(store, m).to(dev)
            reqs.append(dist.isend(buf, dst=m.dst))
            sent += buf.numel() * 8
        elif m.dst == rank and m.src != rank and m.numel:
            buf = torch.empty(m.numel, dtype=torch.float64, device=dev)
            reqs.append(dist.irecv(buf, src=m.src))
            inbox.append((m, buf))
    for r in reqs:
        r.wait()
    for m, buf in inbox:
        _unpack(store, m, buf.cpu())
        received += buf.numel() * 8
    return {"bytes_sent": float(sent), "bytes_received": float(received), "seconds": time.perf_counter() - start}
