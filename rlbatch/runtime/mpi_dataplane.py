"""The data plane over MPI: the same moves as ``rlbatch.runtime.dataplane``, carried by mpi4py's
buffer sends (``Isend``/``Irecv`` of numpy arrays) on the world's communicator instead of
torch.distributed.

It is the transport of a run with no torch.distributed world (``rlbatch.runtime.world``: no role's
engine needs one, ``EngineSpec.needs_torch_world``). The messages are the torch plane's, byte for
byte: per (source, destination) pair one message per dtype part of the move (token ids as int64,
per-token values as float32, ``dataplane._parts``), the fields of its samples concatenated in
the move's order, a field a sample shares with an earlier one of the move (``Move.alias``) left out
and bound to that sample's array on arrival; the receiver sizes its buffers from the lengths the
controller sent. Sends and receives are all posted before any is waited for, so the order of pairs
cannot deadlock.

Torch-free: a field may be anything numpy reads as an array (a numpy array, a CPU torch tensor);
what is received is handed to ``wrap`` (a numpy array, a view into its message's buffer) before it
is kept, so a rank whose engines take torch tensors keeps tensors (``torch.from_numpy``, no copy).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from mpi4py import MPI

from rlbatch.runtime.control import wait_until

if TYPE_CHECKING:
    from rlbatch.runtime.dataplane import Move

DATA_TAG = 21
"""MPI tag of the sample messages (apart from the control plane's command and reply tags)."""
INT_FIELDS = frozenset(("prompt", "response", "image_grid_thw"))
"""Sample fields of integers (token ids, an image's patch grid), moved as int64; every other field
as float32. The torch plane's."""


class Store(Protocol):
    """What the MPI plane needs of a rank's sample store (``dataplane.SampleStore``)."""

    samples: dict[int, dict[str, Any]]

    def put(self, sid: int, name: str, value: Any) -> None: ...


def parts(fields: Sequence[str]) -> list[tuple[type[np.generic], list[str]]]:
    """A move's messages: token ids as int64, per-token values as float32 (``dataplane._parts``)."""
    ints = [f for f in fields if f in INT_FIELDS]
    floats = [f for f in fields if f not in INT_FIELDS]
    return [(dt, fs) for dt, fs in ((np.int64, ints), (np.float32, floats)) if fs]


def _pack(store: Store, m: Move, dtype: type[np.generic], fields: list[str]) -> np.ndarray:
    arrays = [np.asarray(store.samples[sid][f]).reshape(-1) for i, sid in enumerate(m.ids) for f in fields
              if m.sends(i, f)]
    if len(arrays) == 1 and arrays[0].dtype == dtype:
        return np.ascontiguousarray(arrays[0])  # one array already of the message's dtype: no copy
    out = np.empty(sum(a.size for a in arrays), dtype=dtype)
    pos = 0
    for a in arrays:
        out[pos : pos + a.size] = a
        pos += a.size
    return out


def _unpack(store: Store, m: Move, fields: list[str], flat: np.ndarray, wrap: Callable[[np.ndarray], object]) -> None:
    unpack(store, m, fields, flat, wrap)


def unpack(store: Store, m: Move, fields: list[str], flat: Any, wrap: Callable[[Any], object]) -> None:
    """Put the samples' ``fields`` of a received move into ``store``, each a view of ``flat`` (an
    array or a tensor) made a stored value by ``wrap``; a sample that takes an earlier sample's
    fields (``Move.alias``) is given that sample's value, one for all of them. Both data planes."""
    idx = [m.fields.index(f) for f in fields]
    pos = 0
    for i, (sid, lens) in enumerate(zip(m.ids, m.lengths, strict=True)):
        for f, j in zip(fields, idx, strict=True):
            if not m.sends(i, f):  # the earlier sample's array, one for all of them
                store.put(sid, f, store.samples[m.ids[m.alias[i]]][f])
                continue
            store.put(sid, f, wrap(flat[pos : pos + lens[j]]))  # a view into the received buffer
            pos += lens[j]


def exchange(store: Store, rank: int, moves: list[Move], comm: MPI.Comm,
             wrap: Callable[[np.ndarray], object] = lambda a: a, timeout_s: float = 600.0) -> dict[str, float]:
    """Do this rank's part of ``moves`` over ``comm`` (ranks are world ranks): post every send and
    receive, then wait for all, polling (an MPI wait would spin a core: ``rlbatch.runtime.control``)
    for at most ``timeout_s``, the torch plane's group timeout. What it returns is
    ``dataplane.exchange``'s."""
    start = time.perf_counter()
    reqs: list[MPI.Request] = []
    inbox: list[tuple[Move, list[str], np.ndarray]] = []
    keep: list[np.ndarray] = []  # send buffers stay alive until their sends complete
    sent = received = 0
    for m in moves:
        if rank not in (m.src, m.dst) or m.src == m.dst:
            continue
        for dtype, fields in parts(m.fields):
            if m.src == rank:
                buf = _pack(store, m, dtype, fields)
                keep.append(buf)
                reqs.append(comm.Isend(buf, dest=m.dst, tag=DATA_TAG))
                sent += buf.nbytes
            else:
                buf = np.empty(m.size(fields), dtype=dtype)
                reqs.append(comm.Irecv(buf, source=m.src, tag=DATA_TAG))
                inbox.append((m, fields, buf))
    if reqs:
        peers = sorted({m.src if m.dst == rank else m.dst for m in moves if rank in (m.src, m.dst) and m.src != m.dst})
        wait_until(lambda: bool(MPI.Request.Testall(reqs)), timeout_s,
                   lambda: f"the data plane's sample messages on rank {rank} to and from ranks {peers}")
    for m, fields, buf in inbox:
        _unpack(store, m, fields, buf, wrap)
        received += buf.nbytes
    return {"bytes_sent": float(sent), "bytes_received": float(received), "seconds": time.perf_counter() - start}
