"""What the controller's work and traffic grow with: the number of ranks, linearly, never their
square; the samples' lengths, not at all (the samples themselves move rank to rank). Counted, not
timed: MPI probes made while waiting, commands and replies and their pickled bytes
(``rlbatch.runtime.control.Traffic``), and the data plane's rank-to-rank messages and bytes
(``rlbatch.runtime.dataplane.Traffic``)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from mpi4py import MPI

from rlbatch.config.schema import RLBatchConfig
from rlbatch.loop.controller import Pipeline
from rlbatch.runtime.control import REPLY_TAG, STATS_ENV, Controller
from rlbatch.runtime.dataplane import Move, Traffic
from tests.unit.mpi_stand_ins import Message, Sent


class Comm:
    """The controller's communicator: every rank answers each command with an empty phase reply,
    but a reply is found only by a probe that comes after ``silent`` probes which could have found
    it and did not (the rank is still working): probes for its rank, or for any source."""

    def __init__(self, silent: int = 0) -> None:
        self.silent, self.probes = silent, 0
        self.commands: list[tuple[int, tuple[str, dict[str, object]]]] = []
        self.pending: list[int] = []
        self.looked: dict[int, int] = {}
        """Probes so far that could have found each rank's reply."""

    def isend(self, obj: tuple[str, dict[str, object]], dest: int, tag: int) -> Sent:
        self.commands.append((dest, obj))
        self.pending.append(dest)
        return Sent()

    def improbe(self, source: int, tag: int) -> Message | None:
        self.probes += 1
        assert tag == REPLY_TAG
        candidates = self.pending if source == MPI.ANY_SOURCE else [r for r in self.pending if r == source]
        for r in candidates:
            self.looked[r] = self.looked.get(r, 0) + 1
        ready = [r for r in candidates if self.looked[r] > self.silent]
        if not ready:
            return None
        self.pending.remove(ready[0])
        return Message({"xfer": {"seconds": 0.0}}, ready[0])


@pytest.mark.parametrize("ranks", [8, 512])
def test_waiting_for_every_rank_probes_once_a_poll_whatever_the_number_of_ranks(ranks: int) -> None:
    """A phase of the whole world: while it runs, each poll of the wait is one probe (it was one per
    rank still working: at 4096 ranks, polled every millisecond through a 30 s phase, 10^8 probes),
    and each reply one more."""
    comm = Comm(silent=200)
    ctl = Controller(comm, timeout_s=60.0)  # type: ignore[arg-type]
    replies = ctl.call(list(range(ranks)), "phase")
    assert len(replies) == ranks
    assert comm.probes <= 200 + ranks + 1, comm.probes
    assert ctl.traffic.commands == ctl.traffic.replies == ranks
    assert ctl.outstanding == {}


def pipeline(ranks: int, comm: Comm) -> Pipeline:
    """A controller over ``ranks`` worker ranks (the controller is rank ``ranks``)."""
    world = SimpleNamespace(placement=SimpleNamespace(world_size=ranks + 1), comm=comm, timeout_s=60.0, rank=ranks,
                            members={"actor_train": tuple(range(ranks)), "actor_infer": tuple(range(ranks))})
    return Pipeline(world, RLBatchConfig())  # type: ignore[arg-type]


def hand_over(ranks: int, per_rank: int, length: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
              ) -> tuple[Pipeline, Comm]:
    """One step's hand-over: every rank generated ``per_rank`` samples of ``length`` tokens, and each
    is trained on by the next rank (a receive phase of the whole world)."""
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats.jsonl"))
    comm = Comm()
    pipe = pipeline(ranks, comm)
    need: dict[int, tuple[list[int], list[str]]] = {}
    for r in range(ranks):
        ids = [r * per_rank + k for k in range(per_rank)]
        for sid in ids:
            pipe.produced(r, sid, "prompt", 20)
            pipe.produced(r, sid, "response", length)
            pipe.produced(r, sid, "behaviour_logprobs", length)
        need[(r + 1) % ranks] = (ids, ["prompt", "response", "behaviour_logprobs"])
    pipe.start("receive", ("actor_train",), {}, need).result()
    pipe.begin_step()
    return pipe, comm


def test_each_rank_is_sent_its_own_moves_and_the_controller_traffic_is_linear_in_ranks(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    small, comm = hand_over(8, 4, 64, monkeypatch, tmp_path)
    for dest, (_, kwargs) in comm.commands:
        moves = kwargs["moves"]
        assert isinstance(moves, list) and moves and all(dest in (m.src, m.dst) for m in moves)
        assert len(moves) == 2  # what it sends on, what it receives
    large, _ = hand_over(512, 4, 64, monkeypatch, tmp_path)
    for pipe, ranks in ((small, 8), (large, 512)):
        t = pipe.ctl.traffic
        assert (t.commands, t.replies) == (ranks, ranks)
        # rank to rank: per pair one int64 message (prompt + response) and one float32 one
        assert pipe.data_traffic.messages == 2 * ranks
        assert pipe.data_traffic.bytes == ranks * 4 * ((20 + 64) * 8 + 64 * 4)
    per_rank_small = small.ctl.traffic.command_bytes / 8
    per_rank_large = large.ctl.traffic.command_bytes / 512
    assert per_rank_large < 1.25 * per_rank_small, (per_rank_small, per_rank_large)
    rows = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert [(r["commands"], r["data_messages"]) for r in rows] == [(8, 16), (512, 1024)]


def test_the_controller_traffic_does_not_grow_with_response_length(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """The controller knows each sample's length, never its tokens or log-probs: 64 times longer
    responses move 64 times more bytes rank to rank and the same through the controller (an int's
    pickle is a few bytes longer)."""
    short, _ = hand_over(16, 4, 64, monkeypatch, tmp_path)
    long, _ = hand_over(16, 4, 64 * 64, monkeypatch, tmp_path)
    assert long.data_traffic.bytes > 40 * short.data_traffic.bytes
    samples = 16 * 4
    assert long.ctl.traffic.command_bytes <= short.ctl.traffic.command_bytes + 2 * 2 * samples
    assert long.ctl.traffic.reply_bytes == short.ctl.traffic.reply_bytes


def test_data_plane_traffic_counts_one_message_per_dtype_per_pair() -> None:
    t = Traffic()
    t.add([Move(0, 1, [5, 6], ["response", "old_logprobs"], [[3, 3], [4, 4]]),
           Move(2, 2, [7], ["response"], [[9]]),  # held already: nothing moves
           Move(1, 0, [8], ["advantages"], [[10]])])
    assert (t.messages, t.bytes) == (3, 7 * 8 + 7 * 4 + 10 * 4)


def _balance_by_scanning(ids: list[int], tokens: dict[int, int], shards: int, mini_batches: int) -> list[list[int]]:
    """The assignment ``balance_tokens`` makes, found by scanning every shard for each sample."""
    from rlbatch.loop.controller import split_even

    order = {sid: k for k, sid in enumerate(ids)}
    out: list[list[int]] = [[] for _ in range(shards)]
    for mb in split_even(ids, mini_batches):
        quota = [len(x) for x in split_even(mb, shards)]
        load, parts = [0] * shards, [[] for _ in range(shards)]  # type: ignore[var-annotated]
        for sid in sorted(mb, key=lambda i: (-tokens[i], order[i])):
            k = min((k for k in range(shards) if len(parts[k]) < quota[k]), key=lambda k: (load[k], k))
            parts[k].append(sid)
            load[k] += tokens[sid]
        for k in range(shards):
            out[k] += sorted(parts[k], key=order.__getitem__)
    return out


@pytest.mark.parametrize(("samples", "shards", "mini_batches"), [(64, 8, 2), (37, 5, 3), (6, 16, 1), (512, 64, 4)])
def test_token_balancing_takes_the_lightest_shard_with_room_without_scanning_them_all(
        samples: int, shards: int, mini_batches: int) -> None:
    """The shard for each sample comes off a heap (log shards a sample, where scanning every shard
    made a step's balancing samples x shards: quadratic in ranks); the assignment is the scan's."""
    import random

    from rlbatch.loop.controller import balance_tokens

    rng = random.Random(samples * shards)
    ids = list(range(100, 100 + samples))
    tokens = {i: rng.choice([rng.randint(1, 50), 17]) for i in ids}  # ties included
    assert balance_tokens(ids, tokens, shards, mini_batches) == _balance_by_scanning(ids, tokens, shards, mini_batches)


def test_the_controller_counts_the_cpu_it_spends_waiting_apart_from_its_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the stats on, the CPU of polls that found no reply (the ranks still at work) is counted
    apart (``Traffic.idle_cpu_s``), and so is the second pickling that counts the bytes
    (``counting_cpu_s``): neither is the controller's work, which is what the scale harness reports."""
    import time

    monkeypatch.setenv(STATS_ENV, "unused")
    comm = Comm(silent=300)
    ctl = Controller(comm, timeout_s=60.0)  # type: ignore[arg-type]
    cpu = time.process_time()
    ctl.call(list(range(4)), "phase")
    spent = time.process_time() - cpu
    t = ctl.traffic
    assert comm.probes > 300
    assert 0 < t.idle_cpu_s <= spent and 0 < t.counting_cpu_s <= spent
    assert t.idle_cpu_s + t.counting_cpu_s <= spent


class CountedRanks(tuple):  # type: ignore[type-arg]
    """A role's ranks that count how often they are searched."""

    searched = 0

    def __contains__(self, item: object) -> bool:
        CountedRanks.searched += 1
        return super().__contains__(item)


def test_a_phase_that_may_discard_state_looks_each_rank_up_in_a_set_not_the_roles_tuple() -> None:
    """Each rank's command says which of its roles' state may be discarded: the rank was looked up
    in each role's tuple of ranks, a scan of the world per rank (quadratic in ranks)."""
    comm = Comm()
    pipe = pipeline(64, comm)
    pipe.world.members = {"actor_train": CountedRanks(range(64)), "actor_infer": CountedRanks(range(64))}
    pipe.overwritten_next = {"actor_infer": {"weights"}}
    work = {r: {"ids": []} for r in range(64)}
    pipe.start("actor_train.train", ("actor_train",), work).result()
    sent = {dest: kwargs for dest, (_, kwargs) in comm.commands}
    assert all(sent[r]["discard"] == {"actor_infer": ["weights"]} for r in range(64))
    assert CountedRanks.searched == 0


def test_the_controller_collects_its_short_lived_objects_rarely() -> None:
    """A step allocates objects per sample and per rank; with Python's default threshold (700) a
    full collection, which walks everything alive, ran a few times a step at a few hundred ranks.
    After ``fewer_collections`` allocating as much as a 1024-rank step does runs none."""
    import gc

    from rlbatch.runtime.heap import fewer_collections

    full = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    before = gc.get_threshold()
    gc.callbacks.append(count)
    try:
        fewer_collections()
        gc.collect()
        full.clear()
        kept = [{"sid": k, "held": {k % 7}} for k in range(300_000)]  # a step's bookkeeping, alive
        assert len(kept) == 300_000 and full == []
        gc.set_threshold(700, before[1], before[2])
        gc.collect()
        full.clear()
        kept = [{"sid": k, "held": {k % 7}} for k in range(300_000)]
        assert full, "the default threshold runs a full collection over such a step"
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*before)


@pytest.mark.parametrize("per_worker", [8, 512])
def test_what_a_sample_lacks_is_worked_out_once_per_group_of_samples_held_alike(
        per_worker: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples made by one worker share one holders map (``Held``): a phase's moves work out what
    they lack once per (map, destination), not once per field of every sample; a move makes one new
    map for the samples it moved, and leaves the others' as they were."""
    import rlbatch.loop.controller as controller

    pipe = pipeline(4, Comm())
    calls = []
    real = controller._lacking
    monkeypatch.setattr(controller, "_lacking", lambda *a: calls.append(a) or real(*a))
    fields = ["prompt", "response", "behaviour_logprobs"]
    ids_of = {w: list(range(w * per_worker, (w + 1) * per_worker)) for w in (0, 1)}  # two workers of 2 ranks
    for w, ids in ids_of.items():
        pipe.hold((2 * w, 2 * w + 1), ids, fields)
        pipe.length.update((sid, {"prompt": 20, "response": 64, "behaviour_logprobs": 64}) for sid in ids)
    assert len({id(pipe.where[sid]) for sid in pipe.where}) == 2
    # worker 0's samples are read where they are (rank 1), worker 1's first half moves to rank 0
    half = ids_of[1][: per_worker // 2]
    moves = pipe._moves({1: (ids_of[0], fields), 0: (half, fields)})
    assert len(calls) == 2  # (worker 0's map, rank 1) and (worker 1's map, rank 0), whatever the samples
    assert [(m.src, m.dst, m.ids, m.fields) for m in moves] == [(2, 0, half, fields)]
    for m in moves:
        pipe.moved(m)
    assert pipe.where[half[0]] == dict.fromkeys(fields, {0, 2, 3})
    assert pipe.where[ids_of[1][-1]] == dict.fromkeys(fields, {2, 3})
    assert pipe.where[ids_of[0][0]] == dict.fromkeys(fields, {0, 1})
    assert len({id(pipe.where[sid]) for sid in pipe.where}) == 3
    pipe.forget(ids_of[1])
    assert pipe.pending_drop == {0: half, 2: ids_of[1], 3: ids_of[1]} and set(pipe.where) == set(ids_of[0])
