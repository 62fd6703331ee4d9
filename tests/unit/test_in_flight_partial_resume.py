"""Partial rollouts across a checkpoint, through the controller's generation queue
(``GenerationQueue.save`` / ``load``), against the stand-in control plane of
tests/unit/test_in_flight_partial.py whose inference rank keeps samples across generate phases
(tests/unit/test_vllm_in_flight_resume.py runs vLLM itself): the samples in flight at the
checkpoint are saved with the controller's map of them, restored onto the inference rank of a new
queue, and the resumed run hands out the same batches, of the same samples with the same token
versions, as the uninterrupted one; no sample is lost or handed out twice."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbatch.checkpoint.store import CheckpointError
from rlbatch.data.synthetic import Sample
from rlbatch.loop.ahead import KEPT_FILE, GenerationQueue
from tests.unit.test_in_flight_partial import PROMPTS, Keeper, Plane, _queue

N = 2
STEPS, STOP = 8, 3


class Data:
    """The prompt stream: its position is part of the checkpoint."""

    def __init__(self) -> None:
        self.pos = 0

    def next_batch(self, n: int) -> list[Sample]:
        self.pos += n
        return [Sample(f"p{i}", str(i)) for i in range(self.pos - n, self.pos)]


class Holder(Keeper):
    """``Keeper`` with the rollout buffer's operations: the fields of the samples it returned,
    and what it keeps in flight read and restored (``read_kept`` / ``restore_kept``)."""

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[int, dict[str, torch.Tensor]] = {}

    def generate(self, work: Mapping[str, Any]) -> dict[int, Any]:
        out = super().generate(work)
        for sid, (_, length, _) in out.items():
            self.store[sid] = {"prompt": torch.tensor([1, 2, 3]), "response": torch.arange(length)}
        return out

    def buffer(self, work: Mapping[str, Any]) -> Any:
        op = work["op"]
        if op == "read":
            return {sid: {f: self.store[sid][f] for f in work["fields"] if f in self.store[sid]} for sid in work["ids"]}
        if op == "restore":
            self.store.update(work["samples"])
            return {}
        if op == "read_kept":
            return copy.deepcopy({"running": self.running, "finished": self.finished, "ready": self.ready})
        assert op == "restore_kept" and not self.running and not self.finished
        state = copy.deepcopy(work["kept"])
        self.running, self.finished, self.ready = state["running"], state["finished"], state["ready"]
        return {}

    def samples(self) -> list[int]:
        return sorted([*self.running, *self.finished])


class BufferPlane(Plane):
    """``Plane`` that also answers the rollout buffer's commands."""

    def answer(self, phase: str, work: Any) -> Any:
        keeper = self.keeper
        assert isinstance(keeper, Holder)
        return keeper.buffer(work) if phase == "rollout_buffer" else super().answer(phase, work)


def _queue_on(keeper: Holder, data: Data) -> tuple[GenerationQueue, BufferPlane]:
    queue, _, _ = _queue(partial=True)
    plane = BufferPlane(keeper)
    queue.infer.pipe.ctl = plane  # type: ignore[assignment]
    queue.data = data  # type: ignore[assignment]
    return queue, plane


def _steps(queue: GenerationQueue, keeper: Holder, steps: range, got: dict[int, Any]) -> None:
    for step in steps:
        ro = queue.take(step)
        got[step] = (list(ro.ids), {sid: ro.versions[sid] for sid in ro.ids}, queue.dropped, list(ro.answers))
        queue.synced(step + 1)
        keeper.version = step + 1


def _with_state(keeper: Holder) -> Holder:
    """The keeper's ``read_kept`` answered in the form the queue checks (each sample's key)."""
    buffer = keeper.buffer

    def read(work: Mapping[str, Any]) -> Any:
        out = buffer(work)
        if work["op"] == "read_kept":
            out["samples"] = [{"key": k} for k in keeper.samples()]
        return out

    keeper.buffer = read  # type: ignore[method-assign]
    return keeper


def test_samples_in_flight_are_saved_and_the_resumed_queue_hands_out_the_same_batches(tmp_path: Path) -> None:
    whole: dict[int, Any] = {}
    keeper = _with_state(Holder())
    queue, _ = _queue_on(keeper, Data())
    _steps(queue, keeper, range(STEPS), whole)

    split: dict[int, Any] = {}
    first, data = _with_state(Holder()), Data()
    queue, _ = _queue_on(first, data)
    _steps(queue, first, range(STOP + 1), split)
    state = queue.save(tmp_path)  # after the generation sent at step STOP answers (the engine then holds still)
    in_flight = first.samples()
    assert in_flight, "nothing was in flight at the checkpoint: the test would not test the saved samples"
    assert (tmp_path / KEPT_FILE).is_file()

    second = _with_state(Holder())
    resumed, plane = _queue_on(second, Data())
    resumed.data.pos = data.pos  # type: ignore[attr-defined]  (the checkpoint's data position)
    resumed.load(tmp_path, state)
    assert second.samples() == in_flight, "the samples in flight went back onto the inference rank"
    second.version = STOP + 1  # the sync after resume
    _steps(resumed, second, range(STOP + 1, STEPS), split)

    assert split == whole
    handed = [sid for ids, *_ in whole.values() for sid in ids]
    assert len(handed) == len(set(handed)), "a sample was handed out twice"
    after = [sid for step in range(STOP + 1, STEPS) for sid in split[step][0]]
    assert set(in_flight) & set(after), "no sample in flight at the checkpoint was trained after the resume"
    started = set(range(resumed.submitted * PROMPTS * N))
    dropped = set(plane.drops) | set(resumed.infer.pipe.pending_drop.get(1, []))
    assert set(handed) | dropped | set(resumed.kept or {}) == started, "a sample started was lost"


def test_a_checkpoint_that_would_lose_a_sample_in_flight_is_refused(tmp_path: Path) -> None:
    keeper = _with_state(Holder())
    queue, _ = _queue_on(keeper, Data())
    _steps(queue, keeper, range(STOP + 1), {})
    lost = keeper.samples()[0]
    keeper.running.pop(lost, None)
    keeper.finished.pop(lost, None)
    with pytest.raises(RuntimeError, match="lose or duplicate samples in flight"):
        queue.save(tmp_path)


def test_resuming_samples_in_flight_without_partial_rollouts_is_refused(tmp_path: Path) -> None:
    keeper = _with_state(Holder())
    queue, _ = _queue_on(keeper, Data())
    _steps(queue, keeper, range(STOP + 1), {})
    state = queue.save(tmp_path)
    other, _, _ = _queue(partial=False)
    with pytest.raises(CheckpointError, match="partial_rollouts=true"):
        other.load(tmp_path, state)
