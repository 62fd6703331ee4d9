"""The post-mortem names the rank that caused a failure, from the status files and the
launcher's view of which processes ended first."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbatch.config.validate import check
from rlbatch.launch.compose import compose
from rlbatch.placement import Placement
from rlbatch.runtime.postmortem import culprits
from rlbatch.runtime.rundir import RunDir

COLLECTIVE = "rlbatch.runtime.world.CollectiveError: all_reduce in group 'actor_train' failed"


@pytest.fixture
def placement() -> Placement:
    return check(compose([]))  # ranks 0-1: actor; 2: reward; 3: controller


def statuses(tmp_path: Path, states: dict[int, dict[str, object]]) -> RunDir:
    run = RunDir(tmp_path)
    run.logs.mkdir(parents=True)
    for rank, extra in states.items():
        run.write_status(rank, str(extra.pop("state", "running")), **extra)
    return run


def test_an_own_error_is_the_cause(tmp_path: Path, placement: Placement) -> None:
    run = statuses(tmp_path, {0: {"state": "failed", "error": COLLECTIVE, "peers": [1]},
                              1: {}, 2: {"state": "failed", "error": "ValueError: bad reward"}, 3: {}})
    assert culprits(placement, run, [1]) == [
        "rank 2 (reward[0]; node 0) failed on " + str(run.read_status(2)["host"]) + ": ValueError: bad reward"]


def test_the_first_rank_to_end_is_named(tmp_path: Path, placement: Placement) -> None:
    run = statuses(tmp_path, {0: {}, 1: {}, 2: {}, 3: {}})
    (line,) = culprits(placement, run, [1])
    assert line.startswith("rank 1 (actor_train[1]") and "died first" in line


def test_peers_of_failed_collectives_narrow_the_first_exits(tmp_path: Path, placement: Placement) -> None:
    # The launcher killed rank 2 before the kernel reported rank 1 gone; rank 0's failed
    # all_reduce with rank 1 says which of the two is the cause.
    run = statuses(tmp_path, {0: {"state": "failed", "error": COLLECTIVE, "peers": [1]}, 1: {}, 2: {}, 3: {}})
    (line,) = culprits(placement, run, [2, 1, 3])
    assert line.startswith("rank 1 (actor_train[1]") and "died first" in line


def test_the_ranks_that_ended_right_after_are_listed_when_nothing_narrows_them(tmp_path: Path, placement: Placement) -> None:
    run = statuses(tmp_path, {0: {}, 1: {}, 2: {}, 3: {}})
    first, *then, caveat = culprits(placement, run, [2, 1, 3])
    assert first.startswith("rank 2 (reward[0]") and "died first" in first
    assert [ln.split(" (")[0] for ln in then] == ["then rank 1", "then rank 3"]
    assert "may be the cause" in caveat


def test_without_the_launchers_view_suspects_come_first(tmp_path: Path, placement: Placement) -> None:
    run = statuses(tmp_path, {0: {"state": "failed", "error": COLLECTIVE, "peers": [1]}, 1: {}, 2: {}, 3: {}})
    lines = culprits(placement, run)
    assert lines[0].startswith("rank 1 (actor_train[1]")
    assert any(ln.startswith("rank 0 ") and "CollectiveError" in ln for ln in lines)


def test_a_rank_without_a_status_file_never_started(tmp_path: Path, placement: Placement) -> None:
    run = statuses(tmp_path, {0: {}, 1: {}, 2: {}})
    assert any("rank 3 (controller" in ln and "never started" in ln for ln in culprits(placement, run))
