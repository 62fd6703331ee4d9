"""Partial rollouts through the controller's generation queue (``algo.partial_rollouts``), against a
stand-in control plane whose inference rank keeps samples across generate phases as vLLM's
``generate_some`` does (tests/unit/test_vllm_in_flight_partial.py runs vLLM itself): every engine
step adds one token to each running sample, stamped with the version the rank holds, and a phase
answers with the first whole groups to finish. The order of events is checked, not their timing:
a step's batch is handed out while a long sample still generates, that sample ends in a later
step's batch with tokens of several versions, one past the staleness bound is dropped and counted,
and no sample is lost or handed out twice."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlbatch.config.schema import AlgoConfig, RLBatchConfig
from rlbatch.data.synthetic import Sample
from rlbatch.loop.ahead import GenerationQueue, staleness_stats
from rlbatch.loop.controller import Pipeline, Role
from rlbatch.placement import place

TRAINER, INFER, CONTROLLER = 0, 1, 2
PROMPTS, N, K = 2, 2, 2
LONG, TOO_LONG = 5, 9
"""A sample of step 1's prompts that runs past a batch, and one of step 2's that runs past the bound."""
LENGTHS = {LONG: 5, TOO_LONG: 9}


class Keeper:
    """The inference rank's engine: keeps its samples across generate phases."""

    def __init__(self) -> None:
        self.version = 0
        self.running: dict[int, list[int]] = {}  # sample id -> its tokens' versions
        self.finished: dict[int, list[int]] = {}
        self.ready: list[int] = []  # whole groups finished, not returned
        self.started: list[int] = []

    def generate(self, work: Mapping[str, Any]) -> dict[int, Any]:
        n, take = int(work["group"]), int(work["take"])
        for sid in work["ids"]:
            assert sid not in self.started, f"sample {sid} started twice"
            self.running[sid] = []
            self.started.append(sid)
        while len(self.ready) < take:
            assert self.running, "nothing left to finish the batch"
            whole = []
            for sid in sorted(self.running):
                self.running[sid].append(self.version)
                if len(self.running[sid]) == LENGTHS.get(sid, 2):
                    self.finished[sid] = self.running.pop(sid)
                    g = sid // n
                    if all(s in self.finished for s in range(g * n, g * n + n)):
                        whole.append(g)
            self.ready += sorted(whole)
        out = {}
        for g in self.ready[:take]:
            for sid in range(g * n, g * n + n):
                v = self.finished.pop(sid)
                out[sid] = (3, len(v), (min(v), max(v)))
        self.ready = self.ready[take:]
        return out


class Plane:
    """Each rank answers its commands in the order sent, when the controller waits."""

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper
        self.queue: list[tuple[StandInCall, Mapping[int, Mapping[str, Any]]]] = []
        self.drops: list[int] = []

    def send(self, ranks: list[int], cmd: str, timeout_s: float | None = None,
             per_rank: Mapping[int, Mapping[str, Any]] | None = None, label: str | None = None,
             **kwargs: object) -> StandInCall:
        assert per_rank is not None
        call = StandInCall(self, list(ranks))
        self.queue.append((call, per_rank))
        return call

    def run_ranks(self) -> None:
        while self.queue:
            call, per_rank = self.queue.pop(0)
            for r in call.ranks:
                cmd = per_rank[r]
                self.drops += cmd.get("drop") or []
                out = self.answer(cmd["phase"], cmd["work"])
                call.replies[r] = {"xfer": {"seconds": 0.0}, "out": out, "rec": {"phase": cmd["phase"], "seconds": 0.0}}

    def answer(self, phase: str, work: Any) -> Any:
        """A rank's output of ``phase``: the keeper's generations; nothing for the other phases."""
        return self.keeper.generate(work) if phase == "generate" else {}


class StandInCall:
    def __init__(self, plane: Plane, ranks: list[int]) -> None:
        self.plane, self.ranks = plane, ranks
        self.replies: dict[int, Any] = {}

    def wait(self) -> dict[int, Any]:
        self.plane.run_ranks()
        return self.replies


def _queue(partial: bool) -> tuple[GenerationQueue, Keeper, Plane]:
    placement = place({"cluster": {"gpus_per_node": 8}, "roles": {
        "actor_train": {"device_mapping": [TRAINER], "backend": "fsdp:d1"},
        "actor_infer": {"device_mapping": [INFER], "backend": "vllm:d1"}}})
    cfg = RLBatchConfig()
    cfg.algo = AlgoConfig(max_staleness=K, in_flight_updates=True, partial_rollouts=partial, off_policy="tis",
                          prompts_per_step=PROMPTS, samples_per_prompt=N)
    world = SimpleNamespace(placement=placement, comm=None, timeout_s=5.0, rank=CONTROLLER,
                            members={"actor_train": (TRAINER,), "actor_infer": (INFER,)})
    pipe = Pipeline(world, cfg)  # type: ignore[arg-type]
    keeper = Keeper()
    plane = Plane(keeper)
    pipe.ctl = plane  # type: ignore[assignment]
    count = iter(range(10_000))
    data = SimpleNamespace(next_batch=lambda n: [Sample(f"p{i}", str(i)) for i in (next(count) for _ in range(n))])
    scoring = SimpleNamespace(start=lambda ro: None)
    queue = GenerationQueue(Role(pipe, "actor_infer"), [], scoring, data, cfg, K,  # type: ignore[arg-type]
                            partial=partial)
    return queue, keeper, plane


def test_a_long_sample_continues_into_a_later_batch_under_newer_weights_and_none_is_lost() -> None:
    queue, keeper, plane = _queue(partial=True)
    batches: dict[int, list[int]] = {}
    running_when_taken: dict[int, set[int]] = {}
    counted: dict[int, int] = {}
    for step in range(8):
        ro = queue.take(step)
        running_when_taken[step] = set(keeper.running)
        assert len(ro.ids) + queue.dropped == PROMPTS * N, (step, ro.ids, queue.dropped)
        batches[step], counted[step] = ro.ids, queue.dropped
        for sid in ro.ids:  # what the loop trains: each sample's versions, the bound on the oldest token
            assert ro.versions[sid][0] <= ro.versions[sid][1]
        stats = staleness_stats(ro, queue.version, K)
        assert stats["staleness_max"] <= K
        if LONG in ro.ids:
            long_step, long_versions = step, ro.versions[LONG]
        queue.synced(step + 1)  # the step trains; its weights land on the generating rank
        keeper.version = step + 1
    handed = [sid for ids in batches.values() for sid in ids]
    assert len(handed) == len(set(handed)), "a sample was handed out twice"
    # step 1's prompts went in with step 0's generation (at version 0); the long one was still
    # generating when step 1's batch was formed, and ends in a later step's, of several versions
    assert LONG not in batches[0] + batches[1] and LONG in running_when_taken[1]
    assert (long_step, long_versions) == (2, (0, 2))
    assert set(batches[1]) & set(range(PROMPTS * N, 2 * PROMPTS * N)), "step 1 trains on none of its own prompts"
    # the sample past the bound went with its group: dropped on its rank and counted, never trained
    assert TOO_LONG not in handed and TOO_LONG - 1 not in handed
    dropped = plane.drops + queue.infer.pipe.pending_drop.get(INFER, [])  # sent, or going with the next command
    assert {TOO_LONG, TOO_LONG - 1} <= set(dropped) and sum(counted.values()) == len(dropped) == N, (dropped, counted)
    # every sample started is trained, dropped, or still in flight
    started = list(range(queue.submitted * PROMPTS * N))  # the next step's generation is sent, not run yet
    assert sorted(handed + dropped + sorted(queue.kept or {})) == started
    assert set(keeper.started) <= set(started)
    assert set(queue.kept or {}) >= set(keeper.running) | set(keeper.finished)


def test_without_partial_rollouts_the_batch_waits_for_its_longest_sample() -> None:
    """The same workload with generation k steps ahead: each step's batch is its own prompts, so
    the long sample is in step 1's, and the rank held no sample back when it was formed."""
    queue, keeper, plane = _queue(partial=False)
    keeper.generate = lambda work: Keeper.generate(keeper, {**work, "group": N, "take": len(work["ids"]) // N})
    ro = queue.take(0)
    ro = queue.take(1)
    assert LONG in ro.ids and not keeper.running


def test_partial_rollouts_need_in_flight_updates_and_a_staleness_of_two(tmp_path: Path) -> None:
    from tests.unit.test_async import config, problems

    (line,) = problems(config(tmp_path, partial_rollouts=True, max_staleness=2))
    assert line.startswith("algo.partial_rollouts:") and "in_flight_updates=true (got False)" in line, line
