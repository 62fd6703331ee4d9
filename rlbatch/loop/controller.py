"""The controller's view of the pipeline: role handles whose methods are phases.

The controller holds references, not data: for every (sample, field) it knows which ranks hold
it and how long it is. Samples whose fields the same ranks hold share one holders map (``Held``,
copy on write), so the work of a phase goes with the groups of samples made or moved together
rather than with every field of every sample. A phase assigns samples to the ranks that work on
them, preferring the rank that already holds a sample (colocated roles hand over in memory), and
sends each rank one command with the moves it takes part in and its work. Replies carry small
results (lengths, rewards, stats) and a per-rank PhaseRecord for the metrics.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, NotRequired, TypeAlias, TypedDict

import torch

from rlbatch.algos.objective import objective_for
from rlbatch.config.schema import RLBatchConfig, role_algo
from rlbatch.data.synthetic import Sample
from rlbatch.engines.defaults import SYNC_BUCKET_MB, SyncBuckets, max_tokens_per_micro_batch
from rlbatch.engines.registry import spec_of
from rlbatch.envs.trajectories import all_failed
from rlbatch.loop.residency import RecordDict
from rlbatch.models import lora
from rlbatch.phases import IMAGE_FIELDS, PHASES, TRAJECTORY_FIELDS, PhaseSpec, phase_for
from rlbatch.placement import RolePlacement
from rlbatch.runtime.control import Call, Controller, StatsLog
from rlbatch.runtime.dataplane import Move, Traffic
from rlbatch.runtime.postmortem import describe_rank
from rlbatch.runtime.world import World, gpu_device_type

if TYPE_CHECKING:
    from rlbatch.envs.trajectories import TrajectorySummary
    from rlbatch.loop.samples import Shown

PhaseOutput = Any
"""A phase's output on one rank: what its op returns there (``RankRuntime``'s ``_<op>``), unpickled.
Its type depends on the phase (the op is picked by name at run time); the method that started the
phase knows it and reads it as that."""

Work = Mapping[str, object]
"""One rank's part of a phase: the keyword arguments of the phase's op there."""


class Sampling(TypedDict, total=False):
    """Sampling settings as a generate phase sends them: ``SamplingParams``'s fields."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    version: int


class PhaseReply(TypedDict):
    """A rank's reply to a ``phase`` command (``RankRuntime.phase``)."""

    xfer: dict[str, float]
    """The rank's data moves: bytes sent and received, seconds."""
    out: NotRequired[PhaseOutput]
    """The op's output, where the rank worked in the phase."""
    rec: NotRequired[RecordDict]
    """Its PhaseRecord, where the rank worked in the phase."""


@dataclass
class Rollouts:
    """A step's samples: ids in group order (samples_per_prompt consecutive ids per prompt)."""

    ids: list[int]
    answers: list[str]
    group_size: int
    prompt_len: dict[int, int]
    response_len: dict[int, int]
    version: int = 0
    """The policy version (actor updates synced to the inference engine) the generation started with."""
    sources: list[str] = field(default_factory=list)
    """Each sample's data source, in ``ids`` order (``data.reward_fns`` routes by it); empty when
    the dataset names none."""
    episodes: dict[int, TrajectorySummary] = field(default_factory=dict)
    """A run with an environment: each sample's trajectory summary (its reward, turns, end reason,
    ...: ``rlbatch.envs.trajectories.summary``); empty for single-turn samples."""
    versions: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Each sample's (oldest, newest) token version: the policy versions of the weights that sampled
    its first and last tokens (they differ where weights landed mid-generation). A sample missing
    here is of ``version`` throughout."""

    def __post_init__(self) -> None:
        if not any(self.sources):  # a dataset that names no source (or names none of these)
            self.sources = []

    def source_of(self) -> dict[int, str]:
        return dict(zip(self.ids, self.sources, strict=True)) if self.sources else {}

    def oldest(self, sid: int) -> int:
        """The policy version of sample ``sid``'s oldest token: what its staleness is judged by."""
        return self.versions.get(sid, (self.version, self.version))[0]


Held: TypeAlias = "dict[str, frozenset[int]]"
"""Field -> the ranks that hold it, of one sample; shared by the samples held alike and never
changed in place (``Pipeline.hold``, ``Pipeline.moved``: a change replaces it)."""

Kept: TypeAlias = "dict[int, tuple[str, str]]"
"""Partial rollouts: the samples started and not yet returned, by id: (answer, data source)."""


def split_even(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous, sizes differing by at most one."""
    q, r = divmod(len(items), parts)
    out, pos = [], 0
    for k in range(parts):
        n = q + (1 if k < r else 0)
        out.append(items[pos : pos + n])
        pos += n
    return out


def assign_local_first(ids: list[int], ranks: tuple[int, ...], holder: dict[int, int]) -> dict[int, list[int]]:
    """Even split over ``ranks``, keeping each sample on the rank that holds it where possible."""
    quota = dict(zip(ranks, (len(x) for x in split_even(ids, len(ranks))), strict=True))
    out: dict[int, list[int]] = {r: [] for r in ranks}
    left: deque[int] = deque()
    for sid in ids:
        r = holder.get(sid)
        if r is not None and r in out and len(out[r]) < quota[r]:
            out[r].append(sid)
        else:
            left.append(sid)
    for r in ranks:
        while len(out[r]) < quota[r]:
            out[r].append(left.popleft())
    return out


def balance_tokens(ids: list[int], tokens: dict[int, int], shards: int, mini_batches: int) -> list[list[int]]:
    """Each shard's samples, spread by tokens: each of the ``mini_batches`` consecutive global
    mini-batches (``split_even`` of ``ids``) goes to the shards in counts that differ by at most one,
    longest sample first onto the shard with the fewest tokens that still has room, so within a
    mini-batch the shards' tokens differ by about one sample's length. A shard's list is its part of
    mini-batch 0, then of 1, ... (each in ``ids`` order): the trainer's ``mini_batches`` slices of
    it are its parts of the global mini-batches."""
    order = {sid: k for k, sid in enumerate(ids)}
    out: list[list[int]] = [[] for _ in range(shards)]
    for mb in split_even(ids, mini_batches):
        quota = [len(x) for x in split_even(mb, shards)]
        parts: list[list[int]] = [[] for _ in range(shards)]
        room = [(0, k) for k in range(shards) if quota[k] > 0]  # (tokens, shard) of shards with room: a heap
        for sid in sorted(mb, key=lambda i: (-tokens[i], order[i])):
            load, k = heapq.heappop(room)  # the fewest tokens, then the first shard: log(shards) a sample
            parts[k].append(sid)
            if len(parts[k]) < quota[k]:
                heapq.heappush(room, (load + tokens[sid], k))
        for k in range(shards):
            out[k] += sorted(parts[k], key=order.__getitem__)
    return out


def _tokens(ro: Rollouts) -> dict[int, int]:
    """Prompt + response tokens of each sample."""
    return {i: ro.prompt_len.get(i, 0) + ro.response_len.get(i, 0) for i in ro.ids}


@dataclass
class Ledger:
    """Where finished phases leave their per-rank records and their seconds (``PendingPhase.result``)."""

    records: list[RecordDict] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)


def _lacking(of: Held, dst: int, fields: Sequence[str]) -> list[tuple[int, int, tuple[str, ...]]]:
    """The moves (source, ``dst``, fields) a sample held as ``of`` needs for ``dst`` to hold
    ``fields``: each lacking field from the lowest rank holding it, grouped by that rank."""
    by_src: dict[int, list[str]] = {}
    for f in fields:
        held = of.get(f)
        if held and dst not in held:
            by_src.setdefault(min(held), []).append(f)
    return [(src, dst, tuple(fs)) for src, fs in by_src.items()]


def phase_label(phase: str, roles: tuple[str, ...]) -> str:
    """How errors name a phase command: "phase 'sync' of actor_train, actor_infer" (a phase that
    only moves data names the roles it moves it to)."""
    return f"phase '{phase}' of {', '.join(roles)}" if roles else f"phase '{phase}'"


def token_imbalance(assign: dict[tuple[int, ...], list[int]], tokens: dict[int, int]) -> float:
    """Most tokens on one shard over the mean per shard (1: balanced)."""
    per = [sum(tokens[i] for i in ids) for ids in assign.values()]
    mean = sum(per) / max(len(per), 1)
    return max(per) / mean if mean > 0 else 1.0


class Pipeline:
    apart: Ledger | None = None
    """While set, phases started keep their records and seconds there instead of in the step's
    (``records``, ``phase_seconds``), even when they finish during a later step: work that is not
    the step's (evaluation) stays out of its metrics."""

    def __init__(self, world: World, cfg: RLBatchConfig) -> None:
        self.world, self.cfg, self.p = world, cfg, world.placement
        self.ctl = Controller(world.comm, world.timeout_s, lambda r: describe_rank(self.p, r))
        self.where: dict[int, Held] = {}
        """Sample -> field -> the ranks that hold it (a map shared by the samples held alike)."""
        self.length: dict[int, dict[str, int]] = {}
        """Sample -> field -> its number of values."""
        self.shares: dict[int, int] = {}
        """Sample -> the key of its image fields (``IMAGE_FIELDS``), as the generate rank answered: samples
        with one key hold equal values (one prompt's images), which a move sends once (``Move.alias``)."""
        self.pending_drop: dict[int, list[int]] = defaultdict(list)
        self.records: list[RecordDict] = []
        self.phase_seconds: dict[str, float] = {}
        self.started = 0
        self.data_traffic = Traffic()
        """Rank-to-rank messages and bytes of the data moves this controller has ordered."""
        self.stats = StatsLog.from_env()
        """Where each step's start is recorded with the traffic so far (``tools/bench/scale.py``)."""
        self.overwritten_next: dict[str, set[str]] = {}
        """Role -> state kinds whose next use overwrites them (``announce``): an offload before then
        may discard them."""
        self.deferred: list[PendingPhase] = []
        """Phases whose answers the loop collects later (``settle``), oldest first: the inference
        ranks' part of an in-flight sync (``Role.sync_weights`` with ``defer``)."""

    def workers(self) -> list[int]:
        return [r for r in range(self.p.world_size) if r != self.world.rank]

    def wait_ready(self) -> float:
        """Wait until every rank has built its engines (models loaded); return the seconds waited.
        Keeps start-up out of the first step's time."""
        start = time.perf_counter()
        self.ctl.call(self.workers(), "ready", timeout_s=float(self.cfg.cluster.startup_timeout_s),
                      label="start-up ('ready': building the engines; cluster.startup_timeout_s)")
        return time.perf_counter() - start

    def announce(self, phase: str) -> None:
        """``phase`` runs before any other phase uses the state it overwrites (``PhaseSpec.overwrites``),
        so until then that state may leave the device without a copy (vLLM: level-2 sleep, no host
        copy of the weights). Said by a loop that knows, e.g. once a step's generation is done and
        its sync is certain; never said, every offload keeps its state."""
        for role, kind in PHASES[phase].overwrites:
            self.overwritten_next.setdefault(role, set()).add(kind)

    def _discardable(self, phase: str, roles: tuple[str, ...]) -> dict[str, list[str]]:
        """What may be discarded if it leaves the device at the start of ``phase``: the announced
        state of roles that do not work in it. A phase a role works in ends the announcement for
        that role (it is in use, or overwritten, now)."""
        out = {r: sorted(kinds) for r, kinds in self.overwritten_next.items() if r not in roles}
        for r in roles:
            self.overwritten_next.pop(r, None)
        return out

    def _discard_on(self, rank: int, discard: dict[str, list[str]]) -> dict[str, dict[str, list[str]]]:
        """The part of ``discard`` about roles on ``rank``, as a phase command's argument."""
        here = {r: kinds for r, kinds in discard.items() if rank in self._member_sets.get(r, ())}
        return {"discard": here} if here else {}

    @cached_property
    def _member_sets(self) -> dict[str, frozenset[int]]:
        """Each role's ranks as a set: asked for every rank of a phase, a look-up in the role's
        tuple of ranks made the phase's commands quadratic in ranks."""
        return {role: frozenset(ranks) for role, ranks in self.world.members.items()}

    def _moves(self, need: dict[int, tuple[list[int], list[str]]]) -> list[Move]:
        """The moves that bring each rank of ``need`` the fields of the samples it lacks, from the
        lowest rank holding each, grouped by (source, destination, fields). Nothing is made for a
        sample the destination holds whole (the common case: a sample read where it was made).
        What a sample lacks is worked out once per holders map (``Held``) and destination."""
        grouped: dict[tuple[int, int, tuple[str, ...]], list[int]] = defaultdict(list)
        where = self.where
        for dst, (ids, fields) in need.items():
            seen: dict[int, tuple[Held, list[tuple[int, int, tuple[str, ...]]]]] = {}
            for sid in ids:
                of = where.get(sid)
                if of is None:
                    continue
                got = seen.get(id(of))
                if got is None:
                    got = seen[id(of)] = (of, _lacking(of, dst, fields))  # ``of`` kept alive: its id stays its own
                for key in got[1]:
                    grouped[key].append(sid)
        return [self._move(src, dst, ids, list(fs)) for (src, dst, fs), ids in grouped.items()]

    def _move(self, src: int, dst: int, ids: list[int], fields: list[str]) -> Move:
        """A move of ``fields`` of ``ids``; image fields that samples share (``shares``) go once."""
        length = self.length
        lengths = [[length[i][f] for f in fields] for i in ids]
        shared = [f for f in fields if f in IMAGE_FIELDS]
        if shared:
            first: dict[tuple[bool, int], int] = {}
            alias = [first.setdefault((True, self.shares[sid]) if sid in self.shares else (False, sid), k)
                     for k, sid in enumerate(ids)]
            if len(first) < len(ids):
                return Move(src, dst, ids, fields, lengths, shared, alias)
        return Move(src, dst, ids, fields, lengths)

    def run(self, phase: str, roles: tuple[str, ...], work: Mapping[int, Work],
            need: dict[int, tuple[list[int], list[str]]] | None = None) -> dict[int, PhaseOutput]:
        """One phase: move what ``need`` says, run ``work`` on its ranks; return {rank: output}."""
        return self.start(phase, roles, work, need).result()

    def start(self, phase: str, roles: tuple[str, ...], work: Mapping[int, Work],
              need: dict[int, tuple[list[int], list[str]]] | None = None) -> PendingPhase:
        """Start a phase without waiting for it. Phases started after it may run alongside it on
        other ranks, so they must not need its results; ``result()`` them in the order started
        (phases on samples of their own, kept ``apart``, may be waited for later, and so may a
        phase that moves no samples and whose answer nothing reads, kept in ``deferred``)."""
        start = time.perf_counter()
        moves = self._moves(need or {})
        self.data_traffic.add(moves)
        moves_of: dict[int, list[Move]] = defaultdict(list)  # each rank's moves, one pass over them
        for m in moves:
            moves_of[m.src].append(m)
            if m.dst != m.src:
                moves_of[m.dst].append(m)
        ranks = sorted(set(work) | set(moves_of))
        discard = self._discardable(phase, roles) if work else {}
        per_rank = {
            r: {"phase": phase, "roles": roles, "work": work.get(r), "drop": self.pending_drop.pop(r, None),
                "moves": moves_of.get(r, [])} | self._discard_on(r, discard)
            for r in ranks
        }
        # The label names the phase and its roles in the errors of the call: a rank that does not
        # answer in time is reported as stuck in this phase (``rlbatch.runtime.postmortem``).
        label = phase_label(phase, roles)
        return PendingPhase(self, phase, moves, self.ctl.send(ranks, "phase", per_rank=per_rank, label=label), start,
                            self.apart)

    def settle(self) -> None:
        """Wait for every deferred phase's answer, oldest first (its records go to the step in
        progress). Before a checkpoint, at the end of the run and before the next sync: a phase
        whose answer is outstanding may still fail, and a rank answers its commands in order, so
        once it has answered a later one its answer to the deferred one is in hand already."""
        while self.deferred:
            self.deferred[0].result()  # kept until answered: a wait that times out leaves it outstanding
            self.deferred.pop(0)

    def produced(self, ranks: int | tuple[int, ...], sid: int, field: str, length: int) -> None:
        """``field`` of sample ``sid`` (``length`` values) is now held by ``ranks``."""
        self.hold(ranks, (sid,), (field,))
        self.length.setdefault(sid, {})[field] = length

    def hold(self, ranks: int | tuple[int, ...], ids: Iterable[int], fields: Sequence[str]) -> None:
        """``fields`` of each sample of ``ids`` are now held by ``ranks`` (and no longer where they
        were); the samples that shared a holders map before share the new one."""
        held = frozenset((ranks,) if isinstance(ranks, int) else ranks)
        fresh = dict.fromkeys(fields, held)
        where = self.where
        made: dict[int, tuple[Held | None, Held]] = {}  # id of the old map -> (it, kept alive; the new one)
        for sid in ids:
            of = where.get(sid)
            got = made.get(id(of))
            if got is None:
                got = made[id(of)] = (of, of | fresh if of else fresh)
            where[sid] = got[1]

    def moved(self, m: Move) -> None:
        """Move ``m`` is done: its destination holds its fields of its samples too."""
        where, add = self.where, frozenset((m.dst,))
        made: dict[int, tuple[Held, Held]] = {}
        for sid in m.ids:
            of = where[sid]
            got = made.get(id(of))
            if got is None:
                got = made[id(of)] = (of, of | {f: of[f] | add for f in m.fields})
            where[sid] = got[1]

    def forget(self, ids: list[int]) -> None:
        """Samples of a finished step: every rank holding one drops it with its next command."""
        holders: dict[int, set[int]] = defaultdict(set)
        ranks_of: dict[int, tuple[Held, frozenset[int]]] = {}  # id of a holders map -> (it, its ranks)
        for sid in ids:
            of = self.where.pop(sid, None)
            if of is not None:
                got = ranks_of.get(id(of))
                if got is None:
                    got = ranks_of[id(of)] = (of, frozenset().union(*of.values()))
                for r in got[1]:
                    holders[r].add(sid)
            self.length.pop(sid, None)
            self.shares.pop(sid, None)
        for r, sids in holders.items():
            self.pending_drop[r].extend(sorted(sids))

    def holder(self, ids: list[int], field: str = "response") -> dict[int, int]:
        where = self.where
        return {sid: min(of[field]) for sid in ids if (of := where.get(sid)) is not None and field in of}

    def begin_step(self) -> None:
        self.records, self.phase_seconds = [], {}
        if self.stats is not None:
            self.stats.mark(self.ctl.traffic, data_messages=self.data_traffic.messages, data_bytes=self.data_traffic.bytes)


class PendingPhase:
    def __init__(self, pipe: Pipeline, phase: str, moves: list[Move], call: Call, start: float,
                 ledger: Ledger | None = None) -> None:
        self.pipe, self.phase, self.moves, self.call, self.start = pipe, phase, moves, call, start
        self.ledger = ledger
        pipe.started += 1
        self.seq = pipe.started

    def result(self) -> dict[int, PhaseOutput]:
        """Wait for the phase; return {rank: output}. Its time is the slowest working rank's
        own (data moves and the phase itself) when other phases ran meanwhile, else the wall
        time of the round trip."""
        overlapped = self.pipe.started > self.seq  # phases were started after this one
        replies: dict[int, PhaseReply] = self.call.wait()
        p = self.pipe
        for m in self.moves:
            p.moved(m)
        book = self.ledger or Ledger(p.records, p.phase_seconds)  # the step's, as they are now
        records, phase_seconds = book.records, book.phase_seconds
        for r, rep in replies.items():
            if "rec" in rep:  # the controller's own copy (unpickled): the rank is written into it
                rec = rep["rec"]
                rec["rank"] = r
                records.append(rec)
        if overlapped:
            seconds = max((rep["rec"]["seconds"] + rep["xfer"]["seconds"] for rep in replies.values() if "rec" in rep),
                          default=0.0)
        else:
            seconds = time.perf_counter() - self.start
        phase_seconds[self.phase] = phase_seconds.get(self.phase, 0.0) + seconds
        return {r: rep["out"] for r, rep in replies.items() if "out" in rep}


class PendingRollouts:
    """A round of generation under way; ``result()`` waits and returns its Rollouts, with every
    sample's fields recorded as held by each rank of its worker (every rank of a worker keeps
    what the worker generated; its first rank answers and is the one read from)."""

    def __init__(self, pipe: Pipeline, spec: PhaseSpec, pending: PendingPhase, ids_of: dict[tuple[int, ...], list[int]],
                 rollouts: Rollouts, kept: Kept | None = None) -> None:
        self.pipe, self.spec, self.pending, self.ids_of, self.rollouts = pipe, spec, pending, ids_of, rollouts
        self.kept = kept
        self.done = False

    def result(self) -> Rollouts:
        if self.done:
            return self.rollouts
        out = self.pending.result()
        if self.kept is not None:  # partial rollouts: the samples each worker answered with
            self.ids_of = {w: sorted(out[w[0]]) for w in self.ids_of}
            ids = [sid for part in self.ids_of.values() for sid in part]
            missing = [sid for sid in ids if sid not in self.kept]
            if missing:
                raise RuntimeError(f"generate: the inference ranks returned samples {missing[:5]} that are not in "
                                   f"flight ({len(missing)} of {len(ids)}): each sample is returned once")
            known = [self.kept.pop(sid) for sid in ids]
            self.rollouts = replace(self.rollouts, ids=ids, answers=[a for a, _ in known],
                                    sources=[s for _, s in known] if self.rollouts.sources else [])
        ro = self.rollouts
        pipe, writes = self.pipe, self.spec.writes
        for worker, ids in self.ids_of.items():
            answers = out[worker[0]]
            alike: dict[tuple[str, ...], list[int]] = defaultdict(list)  # the samples of each set of fields
            for sid in ids:
                ro.prompt_len[sid], ro.response_len[sid], ro.versions[sid], *rest = answers[sid]
                episode = rest[0] if rest else None  # a trajectory's summary (a run with an environment)
                extra = rest[1] if len(rest) > 1 else {}  # lengths of the image fields of a prompt with images
                if len(rest) > 2:  # and the key of those fields: samples of one key hold the same images
                    pipe.shares[sid] = rest[2]
                if episode is not None:
                    ro.episodes[sid] = episode
                fields = tuple(f for f in writes if not ((f in TRAJECTORY_FIELDS and episode is None)
                                                         or (f in IMAGE_FIELDS and f not in extra)))
                response = ro.response_len[sid]
                lengths = pipe.length.setdefault(sid, {})
                lengths.update(dict.fromkeys(fields, response))
                lengths.update((f, extra[f]) for f in fields if f in extra)
                if "prompt" in fields:
                    lengths["prompt"] = ro.prompt_len[sid]
                alike[fields].append(sid)
            for fields, held in alike.items():
                pipe.hold(worker, held, fields)
        self.done = True
        if (failed := all_failed(ro.episodes)) is not None:
            raise RuntimeError(failed)
        return ro


class Scores:
    """Rewards being computed; ``result()`` waits for them (in the rollouts' order)."""

    def __init__(self, pending: PendingPhase, ids: list[int]) -> None:
        self.pending, self.ids = pending, ids

        self.counts: dict[str, int] = {}
        self.shown: dict[int, Shown] = {}
        """The samples asked for with ``show``, as text (once ``result()`` returned)."""

    def result(self) -> torch.Tensor:
        """The rewards; ``counts`` then holds the scorers' per-step counts, summed over ranks."""
        outs = self.pending.result().values()
        merged = {k: v for o in outs for k, v in o["rewards"].items()}
        for o in outs:
            for k, v in o["counts"].items():
                self.counts[k] = self.counts.get(k, 0) + v
            self.shown |= o.get("shown", {})
        return torch.tensor([merged[i] for i in self.ids], dtype=torch.float32)


class Training:
    """A role's batch of updates under way; ``result()`` waits and averages its shards' stats."""

    def __init__(self, pending: PendingPhase, leaders: list[int], imbalance: float = 1.0) -> None:
        self.pending, self.leaders, self.imbalance = pending, leaders, imbalance

    def result(self) -> dict[str, float]:
        out = self.pending.result()
        stats = [out[r] for r in self.leaders]
        keys = set().union(*(o.keys() for o in stats))
        return {k: sum(o.get(k, 0.0) for o in stats) / len(stats) for k in keys} | {"token_imbalance": self.imbalance}


def shards(role: RolePlacement, ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The groups of the role's ranks that receive the same samples, in data-parallel order.

    A GPU role's ranks are grouped by their coordinates on the engine's data axes
    (``EngineSpec.data_axes``): data-parallel ranks get shares of their own, while the tp/pp/cp
    peers of one replica share one. CPU workers are one rank each. ``ranks``: the role's world
    ranks (for a GPU role, its GPU ranks in device_mapping order)."""
    if not role.is_gpu or not role.mesh:
        return [(r,) for r in ranks]
    axes = spec_of(role.engine).data_axes
    names = [n for n, _ in role.mesh]
    sizes = [s for _, s in role.mesh]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(role.gpu_ranks):
        coords, rest = [], i
        for size in reversed(sizes):  # row-major: the last axis varies fastest
            rest, c = divmod(rest, size)
            coords.append(c)
        coords.reverse()
        key = tuple(coords[names.index(a)] for a in axes if a in names)
        groups.setdefault(key, []).append(r)
    return [tuple(groups[k]) for k in sorted(groups)]


class Role:
    """A role as the controller's loop sees it: each method is one phase on its workers, described
    by its row of the phase table (``rlbatch.phases``)."""

    def __init__(self, pipe: Pipeline, name: str) -> None:
        self.pipe, self.name = pipe, name
        self.placement = pipe.p.roles[name]
        self.shards = shards(self.placement, self.ranks)
        self._assigned: tuple[tuple[int, ...], dict[tuple[int, ...], list[int]]] | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.pipe.world.members[self.name]

    def generate(self, prompts: Sequence[Sample], n: int, first_id: int, seed: int, version: int = 0) -> Rollouts:
        return self.start_generate(prompts, n, first_id, seed, version).result()

    def start_generate(self, prompts: Sequence[Sample], n: int, first_id: int, seed: int, version: int = 0,
                       override: Sampling | None = None, kept: Kept | None = None,
                       take: int | None = None) -> PendingRollouts:
        """Start generating ``n`` samples of each prompt (ids from ``first_id``, in group order)
        on the role's workers; ``result()`` waits for the Rollouts. ``version``: the policy version
        of the weights the engine holds, recorded on the rollouts. ``override``: sampling settings
        in place of the algorithm's (evaluation's temperature). ``kept`` (partial rollouts): the
        samples started and not yet returned, by id; the new ones join them, and the workers answer
        with the first ``take`` whole groups to finish (each its share; default: one per prompt
        given), which may be earlier phases' samples; the rest stay in their engines."""
        spec = phase_for(self.name, "generate")
        a = self.pipe.cfg.algo
        groups = split_even(list(range(len(prompts))), self.placement.world_size)
        takes = [len(t) for t in split_even(list(range(len(prompts) if take is None else take)), len(groups))]
        work: dict[int, Work] = {}
        ids_of: dict[tuple[int, ...], list[int]] = {}
        for w, prompt_idx in enumerate(groups):
            ids = [first_id + i * n + k for i in prompt_idx for k in range(n)]
            ids_of[tuple(self.placement.workers[w])] = ids
            sampling: Sampling = {"max_new_tokens": int(a.max_new_tokens), "temperature": float(a.temperature),
                                  "top_p": float(a.top_p), "seed": seed * 1_000_003 + w, "version": version,
                                  **(override or {})}
            episodes = self._episodes(prompts, prompt_idx, n, first_id)
            partial: dict[str, object] = {"take": takes[w], "group": n} if kept is not None else {}
            # a vision-language prompt's images, once per prompt in the message (pickled by reference)
            pictures = [list(getattr(prompts[i], "images", ())) for i in prompt_idx]
            images = {"images": [p for p in pictures for _ in range(n)]} if any(pictures) else {}
            for r in self.placement.workers[w]:
                work[r] = {"ids": ids, "prompts": [prompts[i].prompt for i in prompt_idx for _ in range(n)],
                           "sampling": sampling} | episodes | partial | images
        pending = self.pipe.start(spec.name, (self.name,), work)
        total = range(len(prompts) * n)
        sources = [str(getattr(prompts[i // n], "data_source", "")) for i in total]
        ro = Rollouts([first_id + i for i in total], [prompts[i // n].answer for i in total], n, {}, {}, version, sources=sources)
        if kept is not None:
            kept.update((sid, (answer, source)) for sid, answer, source in
                        zip(ro.ids, ro.answers, sources, strict=True))
        return PendingRollouts(self.pipe, spec, pending, ids_of, ro, kept)

    def _episodes(self, prompts: Sequence[Sample], prompt_idx: list[int], n: int, first_id: int,
                  ) -> dict[str, object]:
        """With an environment, what each sample's episode starts from: its prompt's task record and
        seed, shared by the prompt's ``n`` samples (one group: n trajectories from one start)."""
        cfg = self.pipe.cfg
        if not cfg.env.name:
            return {}
        from rlbatch.envs.trajectories import episode_seed, task_of

        return {"tasks": [task_of(prompts[i]) for i in prompt_idx for _ in range(n)],
                "seeds": [episode_seed(int(cfg.seed), first_id // n + i) for i in prompt_idx for _ in range(n)]}

    def receive(self, ro: Rollouts, also: tuple[str, ...] = ()) -> PendingPhase:
        """Start moving the rollouts' generated fields that this role's phases read (and those of
        ``also`` made on the inference ranks with them) onto the shards that will work on them
        (the same assignment its phases compute), and nothing else: the holders take part only
        in the move, so a rank that generates next is freed at once."""
        generated = {*phase_for("actor_infer", "generate").writes, *also}
        fields = sorted({f for p in PHASES.values() if p.role == self.name for f in self._reads(p) if f in generated})
        need = {r: (ids, fields) for sh, ids in self._assign(ro).items() for r in sh}
        return self.pipe.start("receive", (self.name,), {}, need)

    def score(self, ro: Rollouts, show: Sequence[int] = ()) -> Scores:
        """Start scoring and return at once: phases started next run alongside it where they are
        on other ranks (a CPU reward role scores while the actor ranks compute log-probs). ``show``:
        samples whose text the scoring ranks send back too (``Scores.shown``: ``rlbatch.loop.samples``)."""
        spec = phase_for(self.name, "score")
        answer, source = dict(zip(ro.ids, ro.answers, strict=True)), ro.source_of()
        parts = split_even(ro.ids, len(self.ranks))
        shown = set(show)
        work = {r: {"ids": ids, "answers": [answer[i] for i in ids]} | ({"sources": [source[i] for i in ids]} if source else {})
                | ({"env_rewards": [float(ro.episodes[i]["reward"]) for i in ids]} if ro.episodes else {})
                | ({"show": {i: ro.episodes[i]["spans"] if ro.episodes else None for i in ids if i in shown}}
                   if shown & set(ids) else {})
                for r, ids in zip(self.ranks, parts, strict=True)}
        need = {r: (ids, list(spec.reads)) for r, ids in zip(self.ranks, parts, strict=True)}
        return Scores(self.pipe.start(spec.name, (self.name,), work, need), ro.ids)

    def _assign(self, ro: Rollouts) -> dict[tuple[int, ...], list[int]]:
        """Samples of each shard: an even split, keeping each sample on the shard that holds it
        (or, with ``_balance``, spread by tokens: ``balance_tokens``).

        Computed once per batch and kept: every phase of the role on these rollouts (receive,
        log-probs, training) sees the same shards in the same order, though the data moves of
        the earlier ones change which ranks hold what. Training's mini-batches are cut from this
        order, and the old log-probs leave out the first one."""
        key = tuple(ro.ids)
        if self._balance and (self._assigned is None or self._assigned[0] != key):
            mini_batches = int(role_algo(self.name, self.pipe.cfg.algo).mini_batches)
            parts = balance_tokens(ro.ids, _tokens(ro), len(self.shards), mini_batches)
            self._assigned = (key, dict(zip(self.shards, parts, strict=True)))
        if self._assigned is None or self._assigned[0] != key:
            leader_of = {r: sh[0] for sh in self.shards for r in sh}
            holder = {sid: leader_of[r] for sid, r in self.pipe.holder(ro.ids).items() if r in leader_of}
            by_leader = assign_local_first(ro.ids, tuple(sh[0] for sh in self.shards), holder)
            self._assigned = (key, {sh: by_leader[sh[0]] for sh in self.shards})
        return self._assigned[1]

    @cached_property
    def _balance(self) -> bool:
        """Spread samples over the shards by tokens (``balance_tokens``): with the role's engine
        running token-budget micro-batches (``rlbatch.engines.defaults.max_tokens_per_micro_batch``
        > 0 on the ranks' device, which the controller judges as they do: ``gpu_device_type``). It
        changes which samples form each global mini-batch (so, the trajectory); it ignores where
        samples are held, so more of them move."""
        if not self.placement.is_gpu or len(self.shards) < 2:
            return False
        return max_tokens_per_micro_batch(self.placement.args, gpu_device_type(self.pipe.cfg.cluster.device)) > 0

    def _start_sharded(self, spec: PhaseSpec, assign: dict[tuple[int, ...], list[int]], fields: list[str],
                       extra: Mapping[int, Work] | None = None) -> PendingPhase:
        """Start ``spec`` with each shard's samples on every rank of the shard."""
        work = {r: {"ids": ids, **(extra or {}).get(sh[0], {})} for sh, ids in assign.items() for r in sh}
        need = {r: (ids, fields) for sh, ids in assign.items() for r in sh}
        return self.pipe.start(spec.name, (self.name,), work, need)

    def _run_sharded(self, spec: PhaseSpec, assign: dict[tuple[int, ...], list[int]], fields: list[str],
                     extra: Mapping[int, Work] | None = None) -> dict[tuple[int, ...], PhaseOutput]:
        """Run ``spec`` with each shard's samples on every rank of the shard; {shard: its leader's output}."""
        out = self._start_sharded(spec, assign, fields, extra).result()
        self.record(spec, assign)
        return {sh: out[sh[0]] for sh in assign}

    def record(self, spec: PhaseSpec, assign: dict[tuple[int, ...], list[int]]) -> None:
        """``spec``'s per-token fields of each shard's samples are held by the shard's first rank."""
        length = self.pipe.length
        for sh, ids in assign.items():
            self.pipe.hold(sh[0], ids, spec.writes)
            for sid in ids:
                lengths = length[sid]
                lengths.update(dict.fromkeys(spec.writes, lengths["response"]))

    def start_logprobs_held(self, assign: dict[tuple[int, ...], list[int]]) -> PendingPhase:
        """Start this role's log-probs of samples every rank of each shard holds already (no data
        moves, so it may be queued behind the phase that makes them); ``record(spec, assign)``
        once it is done."""
        return self._start_sharded(phase_for(self.name, "logprobs"), assign, [])

    def logprobs(self, ro: Rollouts, kl_estimator: str | None = None, skip_first_mini_batch: bool = False,
                 op: str = "logprobs") -> dict[int, float | list[float]]:
        """This role's log-probs of the rollouts (reference: ref_logprobs; actor_train: old_logprobs,
        or with ``op="base_logprobs"`` its base model's as ref_logprobs), kept on its ranks; returns
        each sample's per-token KL to the reference with ``kl_estimator``.

        ``skip_first_mini_batch``: leave out the samples each shard will train on first. The first
        mini-batch of a single epoch is trained before any update, so its old log-probs are the
        current ones, which the training forward computes anyway (same result, less work)."""
        spec = phase_for(self.name, op)
        assign = self._assign(ro)
        if skip_first_mini_batch:
            mbs = int(self.pipe.cfg.algo.mini_batches)
            assign = {sh: ids[len(ids) // mbs :] for sh, ids in assign.items()}
        fields = list(spec.reads) + (["ref_logprobs", *TRAJECTORY_FIELDS] if kl_estimator else [])
        extra = {sh[0]: {"kl_estimator": kl_estimator} for sh in assign} if kl_estimator else None
        out = self._run_sharded(spec, assign, fields, extra)
        return {k: v for o in out.values() for k, v in o.items()}

    def values(self, ro: Rollouts) -> list[torch.Tensor]:
        """The critic's per-token values of the rollouts (in the rollouts' order), also kept on
        its ranks for its own training (the clipped value loss starts from them)."""
        spec = phase_for(self.name, "values")
        out = self._run_sharded(spec, self._assign(ro), list(spec.reads))
        merged = {k: v for o in out.values() for k, v in o.items()}
        return [torch.tensor(merged[i], dtype=torch.float32) for i in ro.ids]

    def train(self, ro: Rollouts, targets: dict[str, torch.Tensor | list[torch.Tensor]]) -> dict[str, float]:
        """One batch of updates towards ``targets``: per-sample fields by name, each one value per
        sample ([N] tensor: ``advantage``) or per token (N tensors: ``advantages``, ``returns``)."""
        return self.start_train(ro, targets).result()

    def start_train(self, ro: Rollouts, targets: dict[str, torch.Tensor | list[torch.Tensor]]) -> Training:
        """``train`` without waiting: a role on other ranks may train meanwhile (``result()`` waits)."""
        spec = phase_for(self.name, "train")
        per_sample = {name: dict(zip(ro.ids, t.tolist() if isinstance(t, torch.Tensor) else [x.tolist() for x in t],
                                     strict=True))
                      for name, t in targets.items()}
        assign = self._assign(ro)
        extra = {sh[0]: {"targets": {name: [v[i] for i in ids] for name, v in per_sample.items()}}
                 for sh, ids in assign.items()}
        return Training(self._start_sharded(spec, assign, self._reads(spec), extra), [sh[0] for sh in assign],
                        token_imbalance(assign, _tokens(ro)))

    def _reads(self, spec: PhaseSpec) -> list[str]:
        """The fields ``spec`` reads: the phase table's, and for training those its objective names."""
        return [*spec.reads, *self._objective_reads] if spec.op == "train" else list(spec.reads)

    @cached_property
    def _objective_reads(self) -> tuple[str, ...]:
        """The extra fields this role's training objective reads (built once, not every step)."""
        return tuple(objective_for(self.name, role_algo(self.name, self.pipe.cfg.algo)).reads)

    def sync_weights(self, infer: Role, version: int = 0, defer: bool = False) -> None:
        """Weights to ``infer``; ``version``: the policy version they are (recorded on the tokens
        sampled with them where they land mid-generation, ``algo.in_flight_updates``).

        ``defer`` (in-flight updates, the two roles on ranks of their own): returns once the
        trainer's ranks have sent the weights. The inference ranks take them between two engine
        steps of the generation they run, but answer the sync command only after that generation;
        their answer is left to ``Pipeline.settle`` (``Pipeline.deferred``). The sync goes out as two
        commands, one to each side, sent together: each rank still runs its commands in the order
        sent, so nothing the controller sends the inference ranks later overtakes the sync."""
        spec = phase_for(self.name, "sync")
        train_ranks, infer_ranks = set(self.ranks), set(infer.ranks)
        local = infer_ranks <= train_ranks
        args = self.placement.args
        bucket = (args.sync_bucket_mb if isinstance(args, SyncBuckets) else SYNC_BUCKET_MB) << 20
        # A LoRA policy's sync moves the adapters alone where the inference engine loads them.
        form = lora.sync_form(self.pipe.cfg.model.lora, spec_of(infer.placement.engine).loads_adapters)
        src = min(self.ranks)
        work = {r: {"src": src, "local": local, "bucket_bytes": bucket, "form": form or "merged", "version": version}
                for r in train_ranks | infer_ranks}
        roles = (self.name, infer.name)
        if defer and not train_ranks & infer_ranks:
            sending = self.pipe.start(spec.name, roles, {r: w for r, w in work.items() if r in train_ranks})
            self.pipe.deferred.append(
                self.pipe.start(spec.name, roles, {r: w for r, w in work.items() if r in infer_ranks}))
            out = sending.result()
        else:
            out = self.pipe.run(spec.name, roles, work)
        # The bytes the sync moved (the most any rank sent or loaded) ride on the sender's record of
        # the phase, which the step's metrics reduce (``sync/bytes``). The sender's answer holds them.
        moved = max((float(o.get("bytes", 0.0)) for o in out.values()), default=0.0)
        rec = next((r for r in reversed(self.pipe.records) if r["phase"] == spec.name and r["rank"] == src), None)
        if rec is not None:
            rec["sync_bytes"] = rec.get("sync_bytes", 0.0) + moved
