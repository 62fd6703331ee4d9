"""Which role's state is on this rank's device, switched at each phase boundary.

Roles colocated on a GPU take turns: before a phase, the state of the other roles on this
rank is offloaded, and so are the acting roles' kinds the phase does not need (a weight sync
leaves the trainer's gradients and optimizer state off the device); then the kinds the phase
needs (from the phase table ``rlbatch.phases``) are reloaded. Each engine moves its own state. A
rank with a single GPU role never offloads. Every phase yields a record: wall time, bytes and
seconds moved each way, device memory (allocated/reserved) and host RSS before and after.

Engines are added as they are built; on a shared rank each one's state leaves the device at once,
so the next engine builds on a free device and the first phase reloads only what it needs.

State whose next use overwrites it whole (the controller says which: ``Pipeline.announce``) may
be discarded instead of kept, by an engine that can (an optional ``discard(kinds)``, e.g. vLLM's
level-2 sleep: no host copy); the others offload it as usual.

``torch.cuda.empty_cache()`` is not called here: offloaded storage returns to PyTorch's caching
allocator, which the next PyTorch engine reuses, and vLLM's ``wake_up`` releases that cache
itself before it maps its own memory (``CuMemAllocator.wake_up``, vLLM 0.32).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NotRequired, TypedDict

import torch

from rlbatch.engines.offload import Transfer
from rlbatch.phases import PHASES

if TYPE_CHECKING:
    from rlbatch.engines.base import Engine

_PAGE = os.sysconf("SC_PAGE_SIZE")


def host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def host_peak() -> int:
    """This process's peak RSS since the previous call (the first call: since the process started),
    exactly: the kernel's high-water mark (VmHWM), which is then reset (``5`` to
    /proc/self/clear_refs). 0 where it cannot be reset, as a peak since the start would pass for
    this interval's."""
    with open("/proc/self/status") as f:
        hwm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return 0
    return hwm


def device_memory(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


class TransferDict(TypedDict):
    """A ``Transfer`` as a plain dict."""

    bytes: int
    seconds: float
    tensors: int


class RecordDict(TypedDict):
    """A ``PhaseRecord`` as a plain dict, the form it travels to the controller in; the controller
    adds the rank that sent it, and the weight sync's sender the bytes it moved."""

    phase: str
    roles: tuple[str, ...]
    seconds: float
    offload: TransferDict
    reload: TransferDict
    discarded: TransferDict
    mem_allocated_before: int
    mem_reserved_before: int
    mem_allocated_after: int
    mem_reserved_after: int
    peak_allocated: int
    rss_before: int
    rss_after: int
    rss_peak_startup: int
    rss_peak: int
    started: float
    rank: NotRequired[int]
    """The rank the record came from (set by the controller: ``PendingPhase.result``)."""
    sync_bytes: NotRequired[float]
    """The bytes a weight sync moved, on its sender's record (``Role.sync_weights``)."""


def _transfer_dict(t: Transfer) -> TransferDict:
    return {"bytes": t.bytes, "seconds": t.seconds, "tensors": t.tensors}


@dataclass
class PhaseRecord:
    phase: str
    roles: tuple[str, ...]
    seconds: float = 0.0
    offload: Transfer = field(default_factory=Transfer)
    reload: Transfer = field(default_factory=Transfer)
    discarded: Transfer = field(default_factory=Transfer)
    """Device state freed without a host copy (its next use overwrites it)."""
    mem_allocated_before: int = 0
    mem_reserved_before: int = 0
    mem_allocated_after: int = 0
    mem_reserved_after: int = 0
    peak_allocated: int = 0
    rss_before: int = 0
    rss_after: int = 0
    rss_peak_startup: int = 0
    """On this rank's first phase, its peak host RSS from the process's start until then (imports,
    engines built); 0 on later phases (``host_peak``)."""
    rss_peak: int = 0
    """Peak host RSS from the end of this rank's previous phase (for its first, this one's start) to
    the end of this one: the data moves before it, its residency switch and its work (``host_peak``)."""
    started: float = 0.0
    """Wall-clock time (epoch seconds) the phase started on this rank: the metrics place it on the
    step's timeline."""

    def as_dict(self) -> RecordDict:
        return {"phase": self.phase, "roles": self.roles, "seconds": self.seconds,
                "offload": _transfer_dict(self.offload), "reload": _transfer_dict(self.reload),
                "discarded": _transfer_dict(self.discarded),
                "mem_allocated_before": self.mem_allocated_before, "mem_reserved_before": self.mem_reserved_before,
                "mem_allocated_after": self.mem_allocated_after, "mem_reserved_after": self.mem_reserved_after,
                "peak_allocated": self.peak_allocated, "rss_before": self.rss_before, "rss_after": self.rss_after,
                "rss_peak_startup": self.rss_peak_startup, "rss_peak": self.rss_peak, "started": self.started}


class Residency:
    def __init__(self, offload: Mapping[str, bool], device: torch.device) -> None:
        """``offload``: every GPU role of this rank, and whether its placement lets it be offloaded."""
        self.engines: dict[str, Engine] = {}
        self.device = device
        shared = len(offload) > 1  # time-division multiplexing only where roles share this device
        self.offloadable = {r for r, ok in offload.items() if shared and ok}
        self._first_phase = True

    def add(self, role: str, engine: Engine) -> Transfer:
        """A newly built engine; on a shared rank its state leaves the device at once (kept, not
        discarded: the first phase may read it)."""
        self.engines[role] = engine
        return engine.offload(engine.state_kinds) if role in self.offloadable else Transfer()

    def _switch(self, acting: tuple[str, ...], needs: tuple[str, ...], discard: Mapping[str, Iterable[str]],
                ) -> tuple[Transfer, Transfer, Transfer]:
        out, back, gone = Transfer(), Transfer(), Transfer()
        for role in sorted(self.offloadable):
            engine = self.engines[role]
            kinds = [k for k in engine.state_kinds if role not in acting or k not in needs]
            may_go = set(discard.get(role, ()))
            drop = getattr(engine, "discard", None)  # optional: not part of the Engine contract
            if may_go & set(kinds) and callable(drop):
                gone += drop([k for k in kinds if k in may_go])
                kinds = [k for k in kinds if k not in may_go]
            if kinds:
                out += engine.offload(kinds)
        for role in acting:
            engine = self.engines[role]
            back += engine.reload(tuple(k for k in engine.state_kinds if k in needs))
        return out, back, gone

    @contextmanager
    def phase(self, phase: str, acting: tuple[str, ...], discard: Mapping[str, Iterable[str]] | None = None,
              ) -> Iterator[PhaseRecord]:
        """Make ``acting`` roles' needed state resident, run the phase, record what happened.
        ``discard``: role -> state kinds whose next use overwrites them, so that if they leave the
        device now their contents need not be kept."""
        rec = PhaseRecord(phase, acting)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        rec.mem_allocated_before, rec.mem_reserved_before = device_memory(self.device)
        rec.rss_before = host_rss()
        if self._first_phase:  # the peak so far is this rank's start-up's
            rec.rss_peak_startup, self._first_phase = host_peak(), False
        start = time.perf_counter()
        rec.started = time.time()
        here = tuple(a for a in acting if a in self.engines)
        rec.offload, rec.reload, rec.discarded = self._switch(here, PHASES[phase].needs, discard or {})
        yield rec
        rec.seconds = time.perf_counter() - start
        rec.mem_allocated_after, rec.mem_reserved_after = device_memory(self.device)
        if self.device.type == "cuda":
            rec.peak_allocated = torch.cuda.max_memory_allocated(self.device)
        rec.rss_after = host_rss()
        rec.rss_peak = host_peak()
