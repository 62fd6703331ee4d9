"""The run directory's lock as a Slurm job takes it when it starts (rlbatch.launch.joblock), on the
real two-node test cluster (slurm/dev-cluster.sh): a job that finds another holder ends before any
rank starts, naming it; a requeued job takes the lock over from its own earlier incarnation.

The dev cluster's nodes share this machine's kernel, so the kernel's lock is shared between them
and the test process, as NFS shares it between hosts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlbatch.launch.joblock import job_lock_lines
from rlbatch.runtime.rundir import LOCK
from tests.unit.test_rundir_lock import hold

pytestmark = pytest.mark.slurm

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def sbatch(script: Path, run_root: Path) -> str:
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={run_root}", str(script)], capture_output=True, text=True,
                         timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def job_record(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)


def wait_for(what: str, ok, timeout: float = 60, every: float = 0.25):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := ok()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(every)
    return value


def lock_record(run: Path) -> dict:
    try:
        return json.loads((run / LOCK).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def holding_job(run: Path, run_root: Path, name: str = "holder") -> str:
    """A job that takes the run directory's lock as the sbatch script does, then sleeps; returns its
    id once its record is in the lock file."""
    script = run_root / f"{name}.sbatch"
    script.write_text("\n".join(["#!/bin/bash", "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --time=5",
                                 f"#SBATCH --output={run_root}/{name}-%j.out", "#SBATCH --open-mode=append",
                                 *job_lock_lines(sys.executable, run), "echo holding", "sleep 300", ""]))
    job = sbatch(script, run_root)
    wait_for(f"job {job} takes the lock", lambda: lock_record(run).get("slurm_job") == job)
    return job


def refused_job(run: Path, run_root: Path) -> tuple[str, dict[str, str], str]:
    """Submit cluster=slurm's own sbatch script for ``run`` with sbatch, around the launcher (as a
    second job submitted by hand would be); returns its id, its final record and its log."""
    from rlbatch.checks.validate import check
    from rlbatch.config.compose import compose
    from rlbatch.launch.slurm import sbatch_script

    cfg = compose(["program=selftest", "cluster=slurm", "cluster.cpus_per_task=1", f"run_dir={run}"])
    (run / "slurm").mkdir(exist_ok=True)  # the job log's folder, which the launcher makes before it submits
    script = run_root / "second.sbatch"
    script.write_text(sbatch_script(cfg, check(cfg, runnable=False), run))
    job = sbatch(script, run_root)
    # slurmctld forgets an ended job after MinJobAge (5 s on the test cluster): watch it closely
    ended = wait_for(f"job {job} ends", lambda: (r := job_record(job)).get("JobState") in ENDED and r, every=0.2)
    return job, ended, (run / "slurm" / f"{job}_0_log.out").read_text()


@pytest.fixture
def run(run_root: Path) -> Iterator[Path]:
    path = run_root / "run"
    path.mkdir()
    yield path


def test_a_job_started_while_another_job_holds_the_run_dir_ends_before_any_rank_starts(run: Path, run_root: Path) -> None:
    first = holding_job(run, run_root)
    holder = lock_record(run)
    job, ended, log = refused_job(run, run_root)
    assert f"rlbatch: Slurm job {job} cannot start: run_dir {run} is in use by another run: pid {holder['pid']} " \
           f"on host {holder['host']}, Slurm job {first}, since " in log, log
    assert "Wait for that run to end, stop it, or choose another run_dir" in log
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "2:0"), ended
    assert not (run / "logs").exists() and not (run / "selftest.json").exists()  # no rank started
    assert lock_record(run) == holder  # the first job's record, untouched
    assert job_record(first).get("JobState") == "RUNNING"


def test_a_job_started_while_a_local_launch_holds_the_run_dir_ends_naming_its_pid(run: Path, run_root: Path) -> None:
    import socket

    local = hold(run)  # a process on this machine, which shares its kernel (and so its locks) with the nodes
    try:
        job, ended, log = refused_job(run, run_root)
    finally:
        local.kill()
        local.wait()
    assert f"rlbatch: Slurm job {job} cannot start: run_dir {run} is in use by another run: pid {local.pid} " \
           f"on host {socket.gethostname()}, since " in log, log
    assert (ended["JobState"], ended["ExitCode"]) == ("FAILED", "2:0"), ended


@pytest.mark.full
def test_a_requeued_job_takes_the_lock_over_from_its_earlier_incarnation(run: Path, run_root: Path) -> None:
    """scontrol requeue: Slurm ends the first incarnation (its batch shell, and with it the lock)
    and starts the job again under the same id (~15 s: the test cluster delays a requeued job's
    start by 10 s); the new incarnation finds the old record naming its own job and takes over."""
    job = holding_job(run, run_root)
    first = lock_record(run)
    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=30)
    second = wait_for("the requeued job takes the lock again",
                      lambda: (r := lock_record(run)).get("since", 0) > first["since"] and r, timeout=120)
    assert second["slurm_job"] == job and job_record(job)["Restarts"] == "1"
    out = (run_root / f"holder-{job}.out").read_text()
    assert out.count("holding") == 2 and "cannot start" not in out, out
