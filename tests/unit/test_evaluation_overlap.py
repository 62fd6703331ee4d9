"""Evaluation alongside training (rlbatch.loop.evaluation): which placements allow it, the
seconds it ran beside training phases, and its schedule as the loop drives it: every row written
once, in step order, never after its step's checkpoint, and every evaluation generated with the
weights it reports."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rlbatch.config.schema import RLBatchConfig
from rlbatch.loop.evaluation import Evaluation, Pending, alongside_others, overlap_seconds, spans

OWN = ("actor_infer", "reward")


def test_evaluation_runs_alongside_only_where_its_roles_have_ranks_of_their_own() -> None:
    disaggregated = {"actor_train": (0,), "reference": (0,), "actor_infer": (1,), "reward": (2,)}
    assert alongside_others(disaggregated, OWN)
    assert not alongside_others(disaggregated | {"actor_infer": (0,)}, OWN)  # colocated with the trainer
    assert not alongside_others(disaggregated | {"reference": (0, 1)}, OWN)  # any other role on an inference rank
    assert not alongside_others(disaggregated | {"reward": (0,)}, OWN)  # a scorer on the trainer's rank
    assert alongside_others(disaggregated | {"critic": (3,), "reward": (1, 2)}, OWN)  # they may share among themselves


def rec(phase: str, roles: tuple[str, ...], start: float, end: float, rank: int = 0) -> dict[str, Any]:
    return {"phase": phase, "roles": roles, "started": start, "seconds": end - start, "rank": rank}


def test_spans_merge_phases_that_overlap_or_touch() -> None:
    assert spans([rec("a", (), 5, 6), rec("b", (), 0, 2), rec("c", (), 1, 3), rec("d", (), 3, 4)]) == [(0, 4), (5, 6)]
    assert spans([]) == []


def test_overlap_seconds_count_training_phases_once_and_leave_the_evaluation_roles_out() -> None:
    evaluation = [rec("generate", ("actor_infer",), 10, 14, rank=1), rec("score", ("reward",), 14, 15, rank=2)]
    step = [rec("generate", ("actor_infer",), 8, 10, rank=1),  # the step's generation, before evaluation's
            rec("score", ("reward",), 10, 11, rank=2),  # an evaluation role: queued beside, not training
            rec("logprobs", ("reference",), 10.5, 12, rank=0), rec("logprobs", ("reference",), 10.5, 12, rank=3),
            rec("train", ("actor_train",), 12, 13.5, rank=0),
            rec("sync", ("actor_train", "actor_infer"), 13.5, 16, rank=0)]  # waits for evaluation: not training
    assert overlap_seconds(evaluation, step, OWN) == pytest.approx(3.0)  # 10.5 .. 13.5, each second once
    assert overlap_seconds(evaluation, step[:2], OWN) == 0.0
    # between steps: every training phase finished before evaluation started
    assert overlap_seconds(evaluation, [rec("train", ("actor_train",), 2, 10)], OWN) == 0.0


class Scripted(Evaluation):
    """The real schedule, with generation and scoring replaced by a record of when they happen and
    with which weights (``held``: the version the inference engine holds, set by the test's loop)."""

    def __init__(self, cfg: RLBatchConfig, overlaps: bool, start: int = 0) -> None:
        self.held = start
        self.events: list[tuple[str, int, int, bool]] = []
        members = {"actor_train": (0,), "actor_infer": (1 if overlaps else 0,), "reward": (2,)}
        pipe = SimpleNamespace(p=SimpleNamespace(roles={r: SimpleNamespace(is_gpu=False, mesh=()) for r in members}),
                               world=SimpleNamespace(members=members), records=[])
        super().__init__(pipe, cfg, start)  # type: ignore[arg-type]
        assert self.overlaps == overlaps

    def _generate(self, p: Pending, overlapped: bool) -> None:
        self.events.append(("generate", p.updates, self.held, overlapped))
        p.gen, p.overlapped = object(), overlapped  # type: ignore[assignment]

    def _score(self, p: Pending) -> None:
        if not p.scored:
            self.events.append(("score", p.updates, self.held, p.overlapped))
            p.scored = True

    def _result(self, p: Pending, records: list[dict[str, Any]]) -> dict[str, float]:
        if p.gen is None:
            self._generate(p, overlapped=False)
        self._score(p)
        return {"eval/updates": float(p.updates), "eval/overlapped": float(p.overlapped)}


def drive(ev: Scripted, steps: int, save_every: int = 0, stop_at: int | None = None, start: int = 0,
          queued: bool = True) -> tuple[list[dict[str, Any]], list[tuple[int, list[int]]]]:
    """The policy-gradient loop's calls (``Loop.generate``, ``sync``, ``end_step``) from ``start``:
    the rows in the order written, and at each checkpoint the steps whose rows were written.
    ``queued=False``: a loop that generates without ``Loop.generate`` (DAPO's rounds)."""
    rows: list[dict[str, Any]] = []
    saves: list[tuple[int, list[int]]] = []
    version = start
    for step in range(start, steps):
        queue_behind = ev.behind()  # Loop.generate: queued behind the step's generation
        if queued and queue_behind is not None:
            queue_behind()
        version += 1  # train
        ev.before_sync()
        ev.held = version  # the sync
        rows += ev.finished([])
        last = step == steps - 1
        saving = last or bool(save_every and (step + 1) % save_every == 0)
        extra = ev.after_step(step, version, [], defer=not saving)
        stop = step == stop_at and not last
        ready = ev.hold({"step": step} | extra, now=stop)
        if ready is not None:
            rows.append(ready)
        if saving or stop:
            saves.append((step, [r["step"] for r in rows]))
        if stop:
            break
    return rows, saves


def config(steps: int, every: int, at_start: bool) -> RLBatchConfig:
    cfg = RLBatchConfig()
    cfg.steps, cfg.eval.every, cfg.eval.at_start = steps, every, at_start
    return cfg


@pytest.mark.parametrize("overlaps", [True, False])
@pytest.mark.parametrize("steps, every, at_start, save_every, stop_at", [
    (7, 2, True, 0, None), (7, 1, False, 0, None), (8, 3, False, 4, None), (6, 2, True, 3, 2), (5, 1, True, 0, 3),
])
def test_every_row_is_written_once_in_order_with_the_evaluation_of_the_weights_it_names(
        overlaps: bool, steps: int, every: int, at_start: bool, save_every: int, stop_at: int | None) -> None:
    ev = Scripted(config(steps, every, at_start), overlaps)
    rows, saves = drive(ev, steps, save_every, stop_at)
    ran = stop_at + 1 if stop_at is not None else steps
    assert [r["step"] for r in rows] == list(range(ran))
    expected = {0: 0.0} if at_start else {}
    expected |= {s: float(s + 1) for s in range(ran) if (s + 1) % every == 0 and not (s == 0 and at_start)}
    expected |= {steps - 1: float(steps)} if stop_at is None else {}  # the last step (a stop is not one)
    assert {r["step"]: r["eval/updates"] for r in rows if "eval/updates" in r} == expected
    for step, written in saves:  # a checkpoint never precedes a row of its steps
        assert written == list(range(step + 1))
    # each evaluation generated (and scored) while the inference engine held the weights it names
    assert all(held == updates for _, updates, held, _ in ev.events)
    assert sorted(u for kind, u, _, _ in ev.events if kind == "generate") == sorted(expected.values())
    overlapped = {r["step"] for r in rows if r.get("eval/overlapped") == 1.0}
    if not overlaps:
        assert not overlapped
    else:  # alongside the next step, except where a checkpoint is saved or the run stops
        saved = {s for s, _ in saves}
        assert overlapped == {s for s in expected if s not in saved or (s == 0 and at_start)}
        assert overlapped  # every case here has one


def test_a_loop_that_generates_by_itself_has_the_evaluation_run_before_its_sync() -> None:
    ev = Scripted(config(5, 2, True), overlaps=True)
    rows, _ = drive(ev, 5, queued=False)
    assert {r["step"]: r["eval/updates"] for r in rows if "eval/updates" in r} == {0: 0.0, 1: 2.0, 3: 4.0, 4: 5.0}
    assert all(held == updates for _, updates, held, _ in ev.events)  # before the weights change
    assert not any(r.get("eval/overlapped") for r in rows)


def test_a_resumed_run_does_not_evaluate_the_initial_weights_again() -> None:
    ev = Scripted(config(6, 2, True), overlaps=True, start=3)
    rows, _ = drive(ev, 6, start=3)
    assert [r["step"] for r in rows] == [3, 4, 5]
    assert {r["step"]: r["eval/updates"] for r in rows if "eval/updates" in r} == {3: 4.0, 5: 6.0}


class Replies:
    """A phase command in flight that has its replies: each rank's record of the phase."""

    def __init__(self, ranks: list[int], phase: str) -> None:
        self.replies = {r: {"out": r, "rec": {"phase": phase, "seconds": 1.0}, "xfer": {"seconds": 0.0}} for r in ranks}

    def wait(self) -> dict[int, Any]:
        return self.replies


def test_phases_started_apart_keep_their_records_out_of_every_step_wherever_they_finish() -> None:
    from rlbatch.loop.controller import Ledger, Pipeline

    world = SimpleNamespace(placement=SimpleNamespace(world_size=3), comm=None, timeout_s=1.0, rank=0,
                            members={"actor_infer": (1,), "actor_train": (2,)})
    pipe = Pipeline(world, RLBatchConfig())  # type: ignore[arg-type]
    pipe.ctl = SimpleNamespace(send=lambda ranks, cmd, per_rank, label="": Replies(ranks, per_rank[ranks[0]]["phase"]))
    ledger = Ledger()
    pipe.apart = ledger
    evaluating = pipe.start("generate", ("actor_infer",), {1: {}})
    pipe.apart = None
    pipe.start("train", ("actor_train",), {2: {}}).result()  # the step's, started after and finished first
    assert [r["phase"] for r in pipe.records] == ["train"] and set(pipe.phase_seconds) == {"train"}
    pipe.begin_step()
    assert evaluating.result() == {1: 1}  # done during the next step: still not that step's
    assert pipe.records == [] and pipe.phase_seconds == {}
    assert ledger.records == [{"phase": "generate", "seconds": 1.0, "rank": 1}]
    assert ledger.phase_seconds == {"generate": 1.0}  # the rank's own time: another phase started meanwhile
