"""An in-flight sync does not hold the controller (``algo.in_flight_updates``): the trainer's ranks
send the weights and answer, the loop goes on, and the inference ranks' answer, which comes only
after the generation they run, is collected later: at the next sync, before a checkpoint and at the
end of the run (``Pipeline.settle``). Run against a stand-in control plane in which each rank
answers its commands in the order sent, as ``rlbatch.runtime.control.serve`` does, and the
inference rank answers nothing while it generates."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlbatch.config.schema import AlgoConfig, RLBatchConfig
from rlbatch.loop.ahead import GenerationQueue
from rlbatch.loop.controller import Pipeline, Role
from rlbatch.loop.program import Loop
from rlbatch.placement import place

TRAINER, INFER, CONTROLLER = 0, 1, 2


class Waited(Exception):
    """The controller waited for an answer the stand-in rank cannot give yet (it would block)."""


class Plane:
    """The controller's end of a stand-in control plane. ``log``: what went out and what came back,
    in order: ('send', phase, ranks), ('answer', phase, rank), ('shutdown', ranks)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.queue: dict[int, list[StandInCall]] = defaultdict(list)
        """Per rank, its commands not answered yet, in the order sent."""
        self.generating: set[int] = set()
        """Ranks inside a generation: they answer nothing (not even a later command) until it ends."""

    def send(self, ranks: list[int], cmd: str, timeout_s: float | None = None,
             per_rank: Mapping[int, Mapping[str, Any]] | None = None, label: str | None = None,
             **kwargs: object) -> StandInCall:
        assert per_rank is not None
        phase = str(per_rank[ranks[0]]["phase"])
        call = StandInCall(self, list(ranks), phase)
        self.log.append(("send", phase, tuple(ranks)))
        for r in ranks:
            self.queue[r].append(call)
        return call

    def run_ranks(self) -> None:
        """Every rank that is not generating answers its commands, oldest first."""
        for r, calls in self.queue.items():
            while calls and r not in self.generating:
                call = calls.pop(0)
                call.replies[r] = {"xfer": {"seconds": 0.0}, "out": {"bytes": 64.0} if call.phase == "sync" else {},
                                   "rec": {"phase": call.phase, "seconds": 0.01}}
                self.log.append(("answer", call.phase, r))

    def end_generation(self, rank: int) -> None:
        self.generating.discard(rank)
        self.run_ranks()

    def shutdown(self, ranks: list[int]) -> None:
        self.log.append(("shutdown", tuple(ranks)))


class StandInCall:
    def __init__(self, plane: Plane, ranks: list[int], phase: str) -> None:
        self.plane, self.ranks, self.phase = plane, ranks, phase
        self.replies: dict[int, Any] = {}

    def wait(self) -> dict[int, Any]:
        self.plane.run_ranks()
        silent = [r for r in self.ranks if r not in self.replies]
        if silent:
            raise Waited(f"the controller waited for rank(s) {silent}'s answer to {self.phase!r}")
        return self.replies


def _loop(in_flight: bool) -> tuple[Loop, Plane]:
    """A loop on a disaggregated placement (actor_train on rank 0, actor_infer on rank 1, the
    controller rank 2) whose control plane is the stand-in; the inference rank is generating step
    1 ahead (k = 1) as step 0's sync begins."""
    placement = place({"cluster": {"gpus_per_node": 8}, "roles": {
        "actor_train": {"device_mapping": [TRAINER], "backend": "fsdp:d1"},
        "actor_infer": {"device_mapping": [INFER], "backend": "vllm:d1"}}})
    cfg = RLBatchConfig()
    cfg.algo = AlgoConfig(max_staleness=1, in_flight_updates=in_flight, off_policy="tis")
    world = SimpleNamespace(placement=placement, comm=None, timeout_s=5.0, rank=CONTROLLER,
                            members={"actor_train": (TRAINER,), "actor_infer": (INFER,)})
    pipe = Pipeline(world, cfg)  # type: ignore[arg-type]
    plane = Plane()
    pipe.ctl = plane  # type: ignore[assignment]
    loop = Loop.__new__(Loop)
    loop.cfg, loop.a, loop.pipe, loop.step, loop.version, loop.stop = cfg, cfg.algo, pipe, 0, 1, None
    loop.actor_train, loop.actor_infer = Role(pipe, "actor_train"), Role(pipe, "actor_infer")
    data = SimpleNamespace(next_batch=lambda n: [])
    loop.queue = GenerationQueue(loop.actor_infer, [], SimpleNamespace(), data, cfg, 1)  # type: ignore[arg-type]
    loop.evaluation = SimpleNamespace(before_sync=lambda: None)  # type: ignore[assignment]
    loop.sync_check = SimpleNamespace(after_sync=lambda step, version: None)  # type: ignore[assignment]
    loop.metrics = SimpleNamespace(close=lambda: None, history=[], path="metrics.jsonl")  # type: ignore[assignment]
    loop.samples = SimpleNamespace(close=lambda: None)  # type: ignore[assignment]
    pipe.start("generate", ("actor_infer",), {INFER: {}})  # step 1's generation, a step ahead
    plane.generating.add(INFER)
    return loop, plane


def test_the_controller_trains_the_next_step_before_the_inference_ranks_answer_the_sync(tmp_path: Path) -> None:
    loop, plane = _loop(in_flight=True)
    loop.sync()  # returns once the trainer has sent the weights: the inference rank still generates
    assert ("answer", "sync", TRAINER) in plane.log and ("answer", "sync", INFER) not in plane.log
    assert loop.queue.version == 1 and len(loop.pipe.deferred) == 1
    # the sync went out to both sides at once, so whatever the controller sends the inference rank
    # later runs there after it
    assert plane.log[:3] == [("send", "generate", (INFER,)), ("send", "sync", (TRAINER,)), ("send", "sync", (INFER,))]
    assert [r["rank"] for r in loop.pipe.records if r.get("sync_bytes")] == [TRAINER]  # the bytes sent, by the sender

    # the next step trains on samples generated already while the inference rank has not answered
    loop.pipe.run("train", ("actor_train",), {TRAINER: {}})
    train_answered = plane.log.index(("answer", "train", TRAINER))
    assert ("answer", "sync", INFER) not in plane.log

    # a checkpoint waits for the outstanding answer: its generation queue's part cannot be written before
    with pytest.raises(Waited, match=r"rank\(s\) \[1\]'s answer to 'sync'"):
        loop.queue.save(tmp_path)
    plane.end_generation(INFER)  # the generation ends: the rank answers it, then the sync
    assert loop.queue.save(tmp_path) == {"policy_version": 1}
    assert loop.pipe.deferred == []
    assert plane.log.index(("answer", "sync", INFER)) > train_answered
    assert [r["rank"] for r in loop.pipe.records if r["phase"] == "sync"] == [TRAINER, INFER]


def test_the_next_sync_and_the_end_of_the_run_collect_the_answer_left_outstanding() -> None:
    loop, plane = _loop(in_flight=True)
    loop.sync()
    with pytest.raises(Waited):  # the run does not end with an answer outstanding (it may still fail)
        loop.finish()
    assert not any(e[0] == "shutdown" for e in plane.log)
    plane.end_generation(INFER)
    loop.pipe.start("generate", ("actor_infer",), {INFER: {}})  # step 2's generation, during which
    plane.generating.add(INFER)  # step 1's sync lands; step 0's answer came in meanwhile
    loop.version = 2
    loop.sync()
    assert len(loop.pipe.deferred) == 1 and plane.log.count(("answer", "sync", INFER)) == 1
    plane.end_generation(INFER)
    assert loop.finish() == {} and plane.log[-1] == ("shutdown", (TRAINER, INFER))
    assert loop.pipe.deferred == [] and plane.log.count(("answer", "sync", INFER)) == 2


def test_without_in_flight_updates_a_sync_waits_for_the_inference_ranks() -> None:
    """A sync that cannot land mid-generation is done only when the inference rank has loaded it,
    after the generation it runs: the controller waits for its answer, as it always has."""
    loop, plane = _loop(in_flight=False)
    with pytest.raises(Waited, match=r"rank\(s\) \[1\]'s answer to 'sync'"):
        loop.sync()
    assert plane.log[1] == ("send", "sync", (TRAINER, INFER))  # one command to both sides
