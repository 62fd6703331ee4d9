"""Which role's state is on this rank's device, switched at each phase boundary.

Roles colocated on a GPU take turns: before a phase, the state of the other roles on this
rank is offloaded and the acting role's state (the kinds the phase needs, from the phase table
``rlbatch.phases``) is reloaded; each engine moves its own state. A rank with a single GPU role
never offloads. Every phase yields a record: wall time, bytes and
seconds moved each way, device memory (allocated/reserved) and host RSS before and after.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rlbatch.engines.offload import Transfer
from rlbatch.phases import PHASES

_PAGE = os.sysconf("SC_PAGE_SIZE")


def host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def device_memory(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


@dataclass
class PhaseRecord:
    phase: str
    roles: tuple[str, ...]
    seconds: float = 0.0
    offload: Transfer = field(default_factory=Transfer)
    reload: Transfer = field(default_factory=Transfer)
    mem_allocated_before: int = 0
    mem_reserved_before: int = 0
    mem_allocated_after: int = 0
    mem_reserved_after: int = 0
    peak_allocated: int = 0
    rss_before: int = 0
    rss_after: int = 0
    started: float = 0.0
    """Wall-clock time (epoch seconds) the phase started on this rank: the metrics place it on the
    step's timeline."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Residency:
    def __init__(self, engines: dict[str, Any], offload: dict[str, bool], device: torch.device) -> None:
        self.engines, self.device = engines, device
        shared = len(engines) > 1  # time-division multiplexing only where roles share this device
        self.offloadable = {r for r, e in engines.items() if shared and offload.get(r, True)}

    def _switch(self, acting: tuple[str, ...], needs: tuple[str, ...]) -> tuple[Transfer, Transfer]:
        out, back = Transfer(), Transfer()
        for role in sorted(self.offloadable - set(acting)):
            engine = self.engines[role]
            out += engine.offload(engine.state_kinds)
        for role in acting:
            engine = self.engines[role]
            back += engine.reload(tuple(k for k in engine.state_kinds if k in needs))
        return out, back

    @contextmanager
    def phase(self, phase: str, acting: tuple[str, ...]) -> Iterator[PhaseRecord]:
        """Make ``acting`` roles' needed state resident, run the phase, record what happened."""
        rec = PhaseRecord(phase, acting)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        rec.mem_allocated_before, rec.mem_reserved_before = device_memory(self.device)
        rec.rss_before = host_rss()
        start = time.perf_counter()
        rec.started = time.time()
        rec.offload, rec.reload = self._switch(tuple(a for a in acting if a in self.engines), PHASES[phase].needs)
        yield rec
        rec.seconds = time.perf_counter() - start
        rec.mem_allocated_after, rec.mem_reserved_after = device_memory(self.device)
        if self.device.type == "cuda":
            rec.peak_allocated = torch.cuda.max_memory_allocated(self.device)
        rec.rss_after = host_rss()
