"""A command that a rank never answers: the controller's wait ends at its deadline with an error
naming the phase (its label), the ranks that did not answer and their roles; the failure report
reads that error back and names the rank that hung, in that phase, as the cause."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
from mpi4py import MPI

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.loop.controller import phase_label
from rlbatch.placement import Placement
from rlbatch.runtime.control import REPLY_TAG, Controller, ControlTimeout
from rlbatch.runtime.postmortem import culprits, describe_rank
from rlbatch.runtime.rundir import RunDir
from tests.unit.mpi_stand_ins import Message, Sent


class Comm:
    """The controller's MPI communicator, with ``answering`` ranks that reply at once and the
    others silent."""

    def __init__(self, answering: set[int]) -> None:
        self.answering, self.pending = answering, set[int]()

    def isend(self, obj: object, dest: int, tag: int) -> Sent:
        if dest in self.answering:
            self.pending.add(dest)
        return Sent()

    def improbe(self, source: int, tag: int) -> Message | None:
        if tag == REPLY_TAG and self.pending and source in (MPI.ANY_SOURCE, *self.pending):
            rank = min(self.pending) if source == MPI.ANY_SOURCE else source
            self.pending.discard(rank)
            return Message({"xfer": {}}, rank)
        return None


@pytest.fixture
def disaggregated() -> Placement:
    return check(compose(["roles=disaggregated"]))  # 0: actor_train + reference; 1: actor_infer; 2: reward; 3: controller


def timed_out(p: Placement, answering: set[int], ranks: list[int], label: str | None) -> ControlTimeout:
    ctl = Controller(Comm(answering), 0.05, lambda r: describe_rank(p, r))  # type: ignore[arg-type]
    with pytest.raises(ControlTimeout) as e:
        ctl.send(ranks, "phase", label=label).wait()
    return e.value


def test_a_phase_without_an_answer_names_the_phase_its_roles_and_the_silent_rank(disaggregated: Placement) -> None:
    e = timed_out(disaggregated, {0}, [0, 1], phase_label("sync", ("actor_train", "actor_infer")))
    assert e.peers == (1,)
    assert str(e) == ("timed out after 0s waiting for phase 'sync' of actor_train, actor_infer: "
                      "no reply from rank 1 (actor_infer[0]; GPU rank 1, node 0)")


def test_a_command_without_a_label_is_named_by_itself(disaggregated: Placement) -> None:
    e = timed_out(disaggregated, set(), [0, 2], None)
    assert e.peers == (0, 2)
    assert "waiting for 'phase': no reply from rank 0 (actor_train[0], reference[0]; GPU rank 0, node 0); rank 2" in str(e)


def status_as_the_worker_writes_it(run: RunDir, rank: int, e: BaseException) -> None:
    """``rlbatch.worker``'s record of a failure: the exception's last line, and its peers."""
    last = traceback.format_exception_only(type(e), e)[-1].strip()
    run.write_status(rank, "failed", error=last, peers=list(getattr(e, "peers", ())))


def test_the_report_names_the_rank_that_hung_in_the_phase(tmp_path: Path, disaggregated: Placement) -> None:
    """The receiving rank hangs in the sync; the sender's broadcast to it times out (a collective
    error naming it as peer); the controller's wait names both. The rank still running when the job
    was stopped is the one that hung."""
    run = RunDir(tmp_path)
    run.logs.mkdir(parents=True)
    for rank in range(4):
        run.write_status(rank, "running")
    status_as_the_worker_writes_it(run, 3, timed_out(disaggregated, set(), [0, 1],
                                                     phase_label("sync", ("actor_train", "actor_infer"))))
    run.write_status(0, "failed", error="rlbatch.runtime.world.CollectiveError: broadcast weights in group 'sync' "
                                         "(world ranks [0, 1]) failed on rank 0 after at most 20s: timed out", peers=[1])
    lines = culprits(disaggregated, run, [2, 1, 0])  # the launcher's view adds nothing: it stopped them all
    host = run.read_status(1)["host"]  # type: ignore[index]
    assert lines[0] == (f"rank 1 (actor_infer[0]; GPU rank 1, node 0) hung in phase 'sync' of actor_train, actor_infer "
                        f"on {host}: no answer within 0s and no error of its own; the launcher stopped it with the rest")
    assert not any(ln.startswith("rank 0 (") and "hung" in ln for ln in lines)
    assert any(ln.startswith("rank 0 (") and "CollectiveError" in ln for ln in lines[1:])
    assert not any("died" in ln for ln in lines)


def test_ranks_that_all_went_silent_are_each_named_suspects_first(tmp_path: Path) -> None:
    """Two ranks silent in one phase, neither failed: one hangs, the other waits for it in a
    collective that has no deadline of its own (as a tensor-parallel peer does inside vLLM). Both
    are named; once a failed collective points at one, that one first."""
    p = check(compose(["roles=disaggregated", 'roles.actor_infer.device_mapping="[1,2]"', "roles.actor_infer.backend=hf:d2"]))
    run = RunDir(tmp_path)
    run.logs.mkdir(parents=True)
    for rank in range(p.world_size):
        run.write_status(rank, "running")
    status_as_the_worker_writes_it(run, p.controller_rank, timed_out(p, set(), [1, 2], phase_label("generate", ("actor_infer",))))
    first, second, caveat, controller = culprits(p, run)
    assert first.startswith("rank 1 (actor_infer[0]; GPU rank 1, node 0) hung in phase 'generate' of actor_infer")
    assert second.startswith("rank 2 (actor_infer[1]; GPU rank 2, node 0) hung in phase 'generate' of actor_infer")
    assert "does not answer either" in caveat
    assert "ControlTimeout" in controller  # the controller's own line follows, with every rank it waited for
    run.write_status(0, "failed", error="rlbatch.runtime.world.CollectiveError: all_gather ...", peers=[2])
    first, second, *_ = culprits(p, run)
    assert first.startswith("rank 2 (") and second.startswith("rank 1 (")


def test_a_rank_with_an_error_of_its_own_stays_the_cause(tmp_path: Path, disaggregated: Placement) -> None:
    run = RunDir(tmp_path)
    run.logs.mkdir(parents=True)
    for rank in range(4):
        run.write_status(rank, "running")
    status_as_the_worker_writes_it(run, 3, timed_out(disaggregated, set(), [1, 2], phase_label("generate", ("actor_infer",))))
    run.write_status(2, "failed", error="ValueError: bad reward")
    (line,) = culprits(disaggregated, run)
    assert line.startswith("rank 2 (reward[0]; node 0) failed on") and line.endswith("ValueError: bad reward")
