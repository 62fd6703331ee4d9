"""The post-mortem names the rank that caused a failure, from the status files and the
launcher's view of which processes ended first."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.placement import Placement
from rlbatch.runtime.env import read_env
from rlbatch.runtime.postmortem import culprits, missing_run_dir
from rlbatch.runtime.rundir import RunDir
from rlbatch.worker import main as worker_main

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


def test_a_run_directory_missing_on_a_node_is_the_cause(tmp_path: Path) -> None:
    two_nodes = check(compose(["cluster.gpus_per_node=1"]))  # GPU rank 0 on node 0, GPU rank 1 + reward on node 1
    run = statuses(tmp_path, {0: {"state": "terminated"}, 3: {"state": "failed", "error": COLLECTIVE}})
    run.missing_on.write_text('{"1": "n2"}')
    assert culprits(two_nodes, run) == [
        f"run directory {tmp_path} missing on node n2: ranks 1-2 (node 1) could not start; "
        f"put run_dir on a filesystem every node sees"]


def test_the_probe_asks_each_node_with_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in srun: answers as the two nodes would when only n1 has the directory.
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "missing n2"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    env = read_env({"SLURM_JOB_NODELIST": "n[1-2]"})
    assert missing_run_dir(tmp_path / "run", [1, 0], env) == {1: "n2"}
    args = (fake.parent / "args").read_text()
    assert "--nodes=2" in args and "--ntasks-per-node=1" in args and "--nodelist=n1,n2" in args
    assert missing_run_dir(tmp_path / "run", [1], read_env({})) == {}  # no allocation: nothing claimed


def test_a_rank_without_its_run_directory_says_so_before_mpi_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_main(str(tmp_path / "absent")) == 1
    err = capsys.readouterr().err
    assert f"run directory {tmp_path / 'absent'} missing on node {socket.gethostname()}" in err
