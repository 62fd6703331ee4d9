"""Fault injection for tests: make one rank fail in a chosen way at a chosen place.

    RLBATCH_FAULT=kill:3               rank 3 kills itself (SIGKILL) at the first fault point
    RLBATCH_FAULT=raise:2:checkpoint   rank 2 raises during a checkpoint write
    RLBATCH_FAULT=hang:0:selftest      rank 0 hangs in the selftest's collectives
    RLBATCH_FAULT=kill:1:generate:3    rank 1 kills itself when it starts its 3rd generation
    RLBATCH_FAULT=hang:1:sync_recv     rank 1 hangs as it starts to receive a weight sync
    RLBATCH_FAULT=hang:1:train         rank 1 hangs as it starts a training phase
    RLBATCH_FAULT=hang:1:sync_bucket:3 rank 1 hangs before the 3rd bucket of the weight syncs' broadcasts
    RLBATCH_FAULT=enospc:*:checkpoint_write   every rank finds the disk full from its first checkpoint write on
    RLBATCH_FAULT=enospc:0,1,3:checkpoint_write:2   ranks 0, 1 and 3 do, from their second one
    RLBATCH_FAULT=drop:1:sync_recv     rank 1's inference engine loads every tensor of each weight sync but the first

``enospc`` fills the disk for this process, as far as Python can see it: from the fault point on,
every open that would allocate space (``O_CREAT``, ``O_APPEND``, ``O_TRUNC``; Python's ``open``,
``os.open``, pathlib, ``torch.save`` through them) fails with ENOSPC, and ``free_bytes`` in
``rlbatch.checkpoint.space`` reports 0 bytes free. Rewriting an existing file in place still works,
as it does on a full filesystem (its blocks are already allocated). Files opened before the fault
point (the rank logs) keep working, unlike a real full disk; ``tools/fault_scenarios/disk_full.py``
fills a real tmpfs for that. ``*`` targets every rank, ``0,1,3`` those ranks.

Fault points (``maybe_fault(place, rank)``): ``generate`` (a rank starts its part of a generation),
``sync_send`` and ``sync_recv`` (the sending rank and each receiving rank start a weight sync),
``sync_bucket`` (before each bucket a rank of the sync group broadcasts or receives),
``checkpoint``, ``checkpoint_write``, ``env_<op>`` (an env worker's requests) and ``selftest``.
``drop`` is carried out by the caller, which ``fault_at`` tells by returning it: at
``sync_recv`` the rank's inference engine receives the sync through ``DropFirst``, which leaves the
first tensor of it unloaded (a weight the sync did not move: what the checked sync,
``rlbatch.loop.synccheck``, must catch). Elsewhere it does nothing.
A ``hang`` never returns: what ends the run is the controller's wait for the phase
(``cluster.timeout_s``), which names the phase and the ranks that did not answer (README.md,
"Timeouts: what ends a hang").

Read through the environment table (rlbatch.runtime.env); does nothing when unset.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from rlbatch.runtime.env import read_env

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_seen: dict[str, int] = {}
"""Fault points passed on this rank, by place (for the n-th-time form)."""
_disk_full = False
_ALLOCATES = os.O_CREAT | os.O_APPEND | os.O_TRUNC


def disk_full() -> bool:
    """Whether an injected ENOSPC fault has filled the disk for this process."""
    return _disk_full


def _enospc_hook(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or len(args) < 3:
        return
    path, mode, flags = args[0], args[1], args[2]
    if isinstance(path, int):  # os.fdopen of an open descriptor: nothing new is allocated
        return
    if str(os.fsdecode(path)).startswith(("/dev/", "/proc/", "/sys/")):  # not on a disk
        return
    allocates = bool(flags & _ALLOCATES) if isinstance(flags, int) else False
    if isinstance(mode, str) and any(c in mode for c in "wax"):
        allocates = True
    if allocates:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def fill_disk() -> None:
    """From now on this process's space-allocating opens fail with ENOSPC (``enospc`` fault)."""
    global _disk_full
    if not _disk_full:
        _disk_full = True
        sys.addaudithook(_enospc_hook)  # audit hooks cannot be removed: the disk stays full


def maybe_fault(where: str, rank: int) -> None:
    fault_at(where, rank)


def fault_at(where: str, rank: int) -> str | None:
    """Inject the fault ``RLBATCH_FAULT`` names if it targets this rank and place (``maybe_fault``);
    returns its kind when the caller carries it out (``drop``), else None."""
    spec = read_env().fault
    if not spec:
        return None
    kind, _, rest = spec.partition(":")
    target, _, place = rest.partition(":")
    place, _, nth = place.partition(":")
    if (target != "*" and rank not in {int(t) for t in target.split(",")}) or (place and place != where):
        return None
    _seen[where] = _seen.get(where, 0) + 1
    if nth and _seen[where] != int(nth):
        return None
    log.warning("injecting fault %r at %s", spec, where)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at {where}")
    elif kind == "hang":
        time.sleep(10**6)
    elif kind == "enospc":
        fill_disk()
    return kind if kind == "drop" else None


class WeightLoader(Protocol):
    """What a weight sync loads into (``rlbatch.loop.weightsync.WeightSink``)."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None: ...


class DropFirst:
    """The ``drop`` fault: a weight sink that loads every tensor of one sync into ``sink`` but the
    first, which keeps the value it had. It gives no views of the engine's memory, so a broadcast
    lands in staging and every bucket passes through ``load_weights``."""

    def __init__(self, sink: WeightLoader) -> None:
        self.sink = sink
        self.dropped: str | None = None

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        kept = []
        for name, tensor in named:
            if self.dropped is None:
                self.dropped = name
                log.warning("fault 'drop': %s is not loaded by this sync", name)
                continue
            kept.append((name, tensor))
        return self.sink.load_weights(kept)

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None
