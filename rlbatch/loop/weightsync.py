"""Weight sync: the trainer's weights into the inference engine, streamed, never the whole model at once.

The trainer exports a ``WeightStream`` (``rlbatch.engines.base``): its manifest (names and full
shapes, known without gathering) and its tensors one gathered unit at a time (an FSDP unit, a
decoder layer). Weights travel in the inference engine's dtype (``wire_dtype``: bf16 for a bf16
engine on a GPU, half the bytes of the trainer's fp32 master weights): the trainer casts its own
shards before gathering them, so the gathers move the wire's bytes too. The inference engine loads
them by name, whatever either does inside.

- Colocated (``load_in_process``): each rank of the trainer loads every unit into its own
  inference engine as it is gathered; a rank holds one unit of gathered weights at a time.
- Across ranks (``WeightBroadcast``): the trainer's first rank broadcasts to the sync group in
  buckets of about ``bucket_bytes``; the manifest is broadcast once, on the first sync, and every
  later sync sends only tensors. Per bucket, the memory broadcast from and into is, in order of
  preference: the inference engine's own parameters, when ``weight_views`` gives them as one slice
  of the wire dtype (the hf engine flattens its parameters so it can): no staging, no copy into the
  model; on the sender, a bucket's single tensor as it is, when it is already contiguous in the
  wire dtype; else one staging buffer kept across buckets and syncs (grow-only; keeping it saves
  allocating, and on CPU page-faulting, a bucket every sync), then ``load_weights`` from views into
  it. The sender copies each tensor into the bucket as it arrives and drops it: it holds the
  bucket and at most one unit.

Every broadcast runs in the sync group, whose collectives time out after ``cluster.timeout_s``
(``rlbatch.runtime.world``): a peer that never arrives ends the sync on this side with a
CollectiveError naming the group, its ranks and the operation, while the controller's wait for the
phase names the rank that did not answer.

With ``algo.in_flight_updates`` (``InFlightSync``) a sync lands on an inference rank between two
engine steps of the generation it runs, instead of after it: the sender first sends each inference
rank a notice over MPI, and a generating rank that finds it joins the broadcast there. The
controller waits only for the trainer's side of such a sync; the inference ranks' answer, which
comes after their generation, it collects later (``rlbatch.loop.controller.Pipeline.settle``).

With ``model.lora`` and an inference engine that loads adapters (``EngineSpec.loads_adapters``), a
sync moves the adapters alone (``rlbatch.models.lora.sync_form``): the trainer streams them
(``export_adapters``) through the same two paths, and the engine receives them through
``AdapterSink`` (its ``load_adapters``), keeping the base weights it started with.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from mpi4py import MPI

from rlbatch.engines.base import WeightStream
from rlbatch.runtime.control import wait_until
from rlbatch.runtime.faults import maybe_fault
from rlbatch.runtime.world import SYNC, World


class WeightSink(Protocol):
    """What a sync loads into: an inference engine (``InferenceEngine``'s part of it), or its
    adapters (``AdapterSink``)."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None: ...


class AdapterLoader(Protocol):
    """An inference engine that loads adapters (``EngineSpec.loads_adapters``)."""

    def load_adapters(self, named: Iterable[tuple[str, torch.Tensor]]) -> int: ...


def buckets(numels: list[int], bucket_bytes: int, element_bytes: int = 4) -> list[tuple[int, int]]:
    """[start, stop) index ranges: consecutive tensors up to bucket_bytes, at least one each."""
    out, i = [], 0
    while i < len(numels):
        j, size = i, 0
        while j < len(numels) and (j == i or (size + numels[j]) * element_bytes <= bucket_bytes):
            size += numels[j]
            j += 1
        out.append((i, j))
        i = j
    return out


@torch.no_grad()
def load_in_process(weights: WeightStream | None, infer: WeightSink | None, dtype: torch.dtype) -> int:
    """Colocated sync on one rank: every unit of ``weights`` in ``dtype`` loaded into ``infer`` as it is
    gathered (``load_weights`` reads it during the call), so the rank holds one unit of gathered weights
    at a time. A trainer rank without the inference engine takes part in the gathers and keeps nothing.
    Returns the bytes loaded."""
    if weights is None:
        return 0
    if infer is None:
        weights.drain(dtype)
        return 0
    total = 0
    for unit in weights.units(dtype):
        total += int(infer.load_weights(unit))
        del unit  # dropped before the next unit is gathered
    return total


class AdapterSink:
    """An inference engine as the receiver of a sync of adapters: each bucket goes to its
    ``load_adapters``; it has no views of its adapters' memory to broadcast into."""

    def __init__(self, engine: AdapterLoader) -> None:
        self.engine = engine

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        return int(self.engine.load_adapters(named))

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None


class WeightBroadcast:
    """Broadcasts full weights over the sync group; one per rank, reused for every sync."""

    def __init__(self, wire_dtype: torch.dtype = torch.float32) -> None:
        self.wire_dtype = wire_dtype
        self._staging: torch.Tensor | None = None
        self._manifest: list[tuple[str, torch.Size]] | None = None

    def manifest(self, world: World, mine: list[tuple[str, torch.Size]] | None, src: int) -> list[tuple[str, torch.Size]]:
        """(hf_name, shape) of every tensor the sender exports, in order: broadcast on the first
        sync, then kept (the sender checks that its export has not changed)."""
        if world.rank == src:
            assert mine is not None
            if self._manifest is not None and mine != self._manifest:
                raise RuntimeError("weight sync: the exported weights changed names or shapes since the first sync")
        if self._manifest is None:
            box: list[Any] = [mine if world.rank == src else None]  # the sender's manifest, once broadcast
            world.check("broadcast weight manifest", SYNC, dist.broadcast_object_list, box, src=src,
                        group=world.groups[SYNC])
            self._manifest = [(str(n), torch.Size(s)) for n, s in box[0]]
        return self._manifest

    def staging(self, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.device != device or buf.numel() < numel:
            self._staging = None  # free the old buffer before allocating the larger one
            buf = self._staging = torch.empty(numel, dtype=self.wire_dtype, device=device)
        return buf[:numel]

    @torch.no_grad()
    def __call__(self, world: World, weights: WeightStream | None, infer: WeightSink | None, src: int,
                 bucket_bytes: int) -> int:
        """Send ``weights`` (on ``src``) or receive into ``infer``; returns the bytes broadcast. Every rank
        that holds the trainer passes its ``weights``: it advances its own stream bucket by bucket in
        step with the sender, since the gathers are collective over the trainer's ranks (a rank that
        both trains and receives would otherwise wait in a gather the sender reaches only after a
        broadcast it has not joined)."""
        dev, sender = world.device, world.rank == src
        if sender and weights is None:
            raise ValueError(f"weight sync: rank {src} sends but holds no trainer weights")
        manifest = self.manifest(world, weights.manifest if sender and weights is not None else None, src)
        if weights is not None and weights.manifest != manifest:
            raise RuntimeError(f"weight sync: rank {world.rank} exports other weights than rank {src}")
        names, shapes = [n for n, _ in manifest], [s for _, s in manifest]
        wire, size = self.wire_dtype, self.wire_dtype.itemsize
        tensors = weights.tensors(wire) if weights is not None else None
        total = 0
        for i, j in buckets([s.numel() for s in shapes], bucket_bytes, size):
            numel = sum(s.numel() for s in shapes[i:j])
            flat = infer.weight_views(names[i:j], wire) if infer is not None else None
            loaded = flat is not None
            if tensors is not None:
                flat = self._fill(tensors, j - i, flat, numel, dev, sender)
            if flat is None:
                flat = self.staging(numel, dev)
            maybe_fault("sync_bucket", world.rank)  # tests: a rank that stops mid-stream
            world.check("broadcast weights", SYNC, dist.broadcast, flat, src=src, group=world.groups[SYNC])
            if infer is not None and not loaded:
                pos, chunk = 0, []
                for n, shape in zip(names[i:j], shapes[i:j], strict=True):
                    chunk.append((n, flat[pos : pos + shape.numel()].view(shape)))
                    pos += shape.numel()
                infer.load_weights(chunk)
                del chunk
            flat = None  # a tensor sent as it is must not outlive its bucket
            total += numel * size
        if tensors is not None and next(tensors, None) is not None:
            raise RuntimeError("weight sync: the export has more tensors than its manifest")
        return total

    def _fill(self, tensors: Iterator[tuple[str, torch.Tensor]], count: int, into: torch.Tensor | None, numel: int,
              device: torch.device, sender: bool) -> torch.Tensor | None:
        """Take the bucket's ``count`` tensors from this rank's export. The sender copies each into
        ``into`` (the receiving engine's own memory), or sends a lone tensor already on the wire as it
        is, or copies into the staging buffer; another trainer rank only takes part in the gathers."""
        if sender and into is None and count == 1:
            _, t = next(tensors)
            if t.dtype == self.wire_dtype and t.device == device and t.is_contiguous():
                return t.reshape(-1)
            into = self.staging(numel, device)
            into.copy_(t.reshape(-1))
            return into
        if sender and into is None:
            into = self.staging(numel, device)
        pos = 0
        for _ in range(count):
            _, t = next(tensors)
            if sender:
                assert into is not None
                into[pos : pos + t.numel()].view(t.shape).copy_(t)
            pos += t.numel()
            del t  # copied: not held while the next tensor is gathered
        return into


# -- in-flight updates (``algo.in_flight_updates``) ---------------------------------------------

NOTICE_TAG = 31
"""MPI tag of the notice the sender sends each inference rank as an in-flight sync begins."""


@dataclass(frozen=True)
class SyncNotice:
    """What an inference rank needs to join a sync it was not sent the command of yet."""

    version: int
    """The policy version of the weights being sent."""
    bucket_bytes: int


class LoadsInFlight(Protocol):
    """An inference engine that takes weights between two of its engine steps
    (``EngineSpec.loads_in_flight``): while ``between_steps`` is set, its ``generate`` calls it before
    every engine step; a call that returns a version has loaded that version's weights (through the
    engine's ``load_weights``), and the tokens of the steps after it carry that version. The hook
    ``landing`` sets (``InFlightHook``) also answers in two parts, for an engine that must pause its
    generation before it receives: ``pending()`` (has a sync begun?) and ``receive()`` (take it now)."""

    between_steps: Callable[[], int | None] | None


class InFlightSync:
    """A weight sync that lands on an inference rank wherever the rank is: between two engine steps
    of a generation (``poll``), or, when it is not generating, in the sync phase itself (``receive``).

    The sender (the trainer's first rank) sends every other rank of the sync group a ``SyncNotice``
    over MPI (``notify``) and then broadcasts as usual. A generating rank finds the notice between
    two engine steps and joins the broadcast there, so the sync never waits for the generation; the
    sync phase, which reaches the rank after the generation, then answers with what was received
    (``taken``, in order: with max_staleness >= 2 several syncs may land during one generation). A
    rank that is not generating waits for the notice in the sync phase and joins as before.

    ``peers``: the ranks of this rank's inference worker, when it has several (tensor-parallel
    ranks whose engines step in lockstep, vLLM's ``external_launcher``): a sync then lands on all of
    them at the same engine step (``agreed``), though their notices arrive apart."""

    def __init__(self, world: World, broadcast: WeightBroadcast, src: int, peers: tuple[int, ...] = ()) -> None:
        self.world, self.broadcast, self.src = world, broadcast, src
        self.peers: MPI.Comm | None = None
        """The worker's ranks, when it has several: where they agree on the step a sync lands at."""
        if len(peers) > 1:
            comm = cast("MPI.Intracomm", world.comm)  # the world's communicator
            self.peers = comm.Create_group(comm.group.Incl(sorted(peers)))
        self._notice: MPI.Request | None = None
        self._pending: SyncNotice | None = None  # found by ``pending``, not received yet
        self._sent: list[MPI.Request] = []
        self.taken: deque[tuple[int, int]] = deque()
        """(version, bytes) of the syncs received mid-generation whose sync phase has not run yet."""

    def notify(self, version: int, bucket_bytes: int) -> None:
        """On the sender, as a sync begins: the notice to every inference rank (sent without waiting;
        the broadcast that follows cannot finish before each rank has taken it)."""
        for req in self._sent:
            req.wait()
        notice = SyncNotice(version, bucket_bytes)
        self._sent = [self.world.comm.isend(notice, dest=r, tag=NOTICE_TAG)
                      for r in self.world.members[SYNC] if r != self.src]

    def _posted(self) -> MPI.Request:
        if self._notice is None:
            self._notice = self.world.comm.irecv(source=self.src, tag=NOTICE_TAG)
        return self._notice

    def _take(self) -> SyncNotice | None:
        done, notice = self._posted().test()
        if not done:
            return None
        self._notice = None
        assert isinstance(notice, SyncNotice)
        return notice

    def pending(self) -> bool:
        """Between two engine steps: whether a sync has begun (its notice arrived), at once. The
        notice is kept until ``take`` receives the sync."""
        if self._pending is None:
            self._pending = self._take()
        return self._pending is not None

    def agreed(self) -> bool:
        """Between two engine steps: whether a sync lands now, the same answer on every rank of the
        worker (``peers``): one that has found its notice is enough, and a rank whose notice is still
        on its way waits for it (the sender sends every rank of the sync group one before it
        broadcasts). Without peers, ``pending``."""
        mine = self.pending()
        if self.peers is None or not self.peers.allreduce(mine, op=MPI.LOR):
            return mine
        if not mine:
            wait_until(self.pending, self.world.timeout_s,
                       lambda: f"the notice of a weight sync from rank {self.src}, which a peer of this worker has")
        return True

    def take(self, infer: WeightSink) -> int:
        """Receive the sync ``pending`` found into ``infer`` now; returns its version."""
        notice, self._pending = self._pending, None
        if notice is None:
            raise RuntimeError("in-flight weight sync: take() without a pending sync (pending() found none)")
        nbytes = self.broadcast(self.world, None, infer, self.src, notice.bucket_bytes)
        self.taken.append((notice.version, nbytes))
        return notice.version

    def poll(self, infer: WeightSink) -> int | None:
        """Between two engine steps: when a sync has begun (on every rank of the worker: ``agreed``),
        receive it into ``infer`` now and return its version; else None at once."""
        return self.take(infer) if self.agreed() else None

    def receive(self, infer: WeightSink) -> tuple[int, int]:
        """In the sync phase on an inference rank: the (version, bytes) of the oldest sync taken
        mid-generation, or, when none was, this one, received now."""
        if self.taken:
            return self.taken.popleft()
        if self._pending is None:  # else found between two steps of a generation that then ended
            wait_until(self.pending, self.world.timeout_s, lambda: f"the notice of a weight sync from rank {self.src}")
        notice, self._pending = self._pending, None
        assert notice is not None
        nbytes = self.broadcast(self.world, None, infer, self.src, notice.bucket_bytes)
        return notice.version, nbytes


class InFlightHook:
    """What ``landing`` gives a generating engine as its ``between_steps``: called, a sync received
    if one has begun (``InFlightSync.poll``); or in two parts, for an engine that pauses its
    generation first (sglang): ``pending`` at once, then ``receive``."""

    def __init__(self, sync: InFlightSync, sink: WeightSink) -> None:
        self.sync, self.sink = sync, sink

    def __call__(self) -> int | None:
        return self.sync.poll(self.sink)

    def pending(self) -> bool:
        return self.sync.pending()

    def receive(self) -> int:
        return self.sync.take(self.sink)


@contextmanager
def landing(engine: object, sync: InFlightSync | None) -> Iterator[None]:
    """While a generation runs on ``engine``: syncs land between its engine steps (``InFlightHook``),
    when in-flight updates are on (``sync`` given) and the engine takes them; else nothing."""
    if sync is None or not hasattr(engine, "between_steps"):
        yield
        return
    target = cast("LoadsInFlight", engine)
    target.between_steps = InFlightHook(sync, cast("WeightSink", engine))
    try:
        yield
    finally:
        target.between_steps = None
