"""Fault injection for tests: make one rank fail in a chosen way at a chosen place.

    RLBATCH_FAULT=kill:3               rank 3 kills itself (SIGKILL) at the first fault point
    RLBATCH_FAULT=raise:2:checkpoint   rank 2 raises during a checkpoint write
    RLBATCH_FAULT=hang:0:selftest      rank 0 hangs in the selftest's collectives
    RLBATCH_FAULT=kill:1:generate:3    rank 1 kills itself when it starts its 3rd generation

Read through the environment table (rlbatch.runtime.env); does nothing when unset.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from rlbatch.runtime.env import read_env

log = logging.getLogger(__name__)
_seen: dict[str, int] = {}
"""Fault points passed on this rank, by place (for the n-th-time form)."""


def maybe_fault(where: str, rank: int) -> None:
    spec = read_env().fault
    if not spec:
        return
    kind, _, rest = spec.partition(":")
    target, _, place = rest.partition(":")
    place, _, nth = place.partition(":")
    if int(target) != rank or (place and place != where):
        return
    _seen[where] = _seen.get(where, 0) + 1
    if nth and _seen[where] != int(nth):
        return
    log.warning("injecting fault %r at %s", spec, where)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at {where}")
    elif kind == "hang":
        time.sleep(10**6)
