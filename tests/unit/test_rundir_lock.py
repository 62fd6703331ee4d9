"""One run per run directory: the lock a launch takes before it writes anything."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbatch.runtime.rundir import LOCK, lock_run_dir
from tests.conftest import REPO_ROOT, launch

HOLD = """
import sys, time
from pathlib import Path
from rlbatch.runtime.rundir import lock_run_dir
lock_run_dir(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
print("held", flush=True)
time.sleep(600)
"""


def hold(run_dir: Path, *job: str) -> subprocess.Popen[str]:
    """A process that takes the run directory's lock and keeps it until killed."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), *job], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def in_a_child(run_dir: Path, job: str | None = None) -> str:
    """Try the lock from a fresh process (this one may hold it already): 'ok' or the refusal."""
    code = ("import sys; from pathlib import Path; from rlbatch.runtime.rundir import lock_run_dir, RunDirBusy\n"
            "try:\n    lock_run_dir(Path(sys.argv[1]), sys.argv[2] or None); print('ok')\n"
            "except RunDirBusy as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir), job or ""], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=60)
    return out.stdout.strip() + out.stderr.strip()


def test_a_second_launch_is_refused_before_it_writes_anything(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("the first run's\n")
    holder = hold(run)
    try:
        out = launch([f"run_dir={run}", "steps=1"], tmp_path, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"pid {holder.pid} on host {socket.gethostname()}" in out.stderr
    assert "Wait for that run to end, stop it, or choose another run_dir" in out.stderr
    assert "run_dir:" not in out.stdout  # the local launcher never got as far as starting mpiexec
    assert (run / "config.yaml").read_text() == "the first run's\n"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", LOCK]


def test_a_holder_killed_with_sigkill_does_not_block(tmp_path: Path) -> None:
    holder = hold(tmp_path)
    assert f"pid {holder.pid}" in in_a_child(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == holder.pid  # its record is left behind
    lock = lock_run_dir(tmp_path)  # the kernel released its lock: the record is stale
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK).read_text() == ""  # released: an empty record


def record(run_dir: Path, **rec: object) -> None:
    (run_dir / LOCK).write_text(json.dumps({"since": time.time()} | rec))


def test_a_holder_on_another_host_is_taken_to_be_alive(tmp_path: Path) -> None:
    # The kernel's lock is free, but it may not be shared between hosts on this filesystem.
    record(tmp_path, host="node-b", pid=4242, slurm_job=None)
    refusal = in_a_child(tmp_path)
    assert "pid 4242 on host node-b" in refusal and f"delete {tmp_path / LOCK}" in refusal


@pytest.fixture
def squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fake squeue on PATH that reports the state given to it (in a file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "state"
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ns=$(cat {state})\n"
                                    "if [ \"$s\" = gone ]; then echo 'slurm_load_jobs error: Invalid job id specified' >&2; "
                                    "exit 1; fi\necho \"$s\"\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return state.write_text


@pytest.mark.parametrize(("state", "ours", "refused"), [
    ("RUNNING", None, True), ("PENDING", None, True), ("COMPLETED", None, False), ("gone", None, False),
    ("RUNNING", "77", False),  # the job's own next incarnation (a requeue)
])
def test_a_run_dir_handed_to_a_slurm_job_is_its_while_slurm_runs_it(tmp_path: Path, squeue, state: str,
                                                                     ours: str | None, refused: bool) -> None:
    squeue(state)
    record(tmp_path, host="login1", pid=None, slurm_job="77")
    out = in_a_child(tmp_path, ours)
    if refused:
        assert "Slurm job 77" in out and f"Slurm reports the job {state}" in out, out
    else:
        assert out == "ok", out


def test_hand_over_leaves_the_job_as_the_holder(tmp_path: Path, squeue) -> None:
    squeue("PENDING")
    lock_run_dir(tmp_path).hand_over("91")
    rec = json.loads((tmp_path / LOCK).read_text())
    assert (rec["slurm_job"], rec["pid"]) == ("91", None)
    assert "Slurm job 91" in in_a_child(tmp_path)


def test_the_refusal_names_the_holders_slurm_job(tmp_path: Path) -> None:
    holder = hold(tmp_path, "55")
    try:
        assert f"pid {holder.pid} on host {socket.gethostname()}, Slurm job 55, since " in in_a_child(tmp_path, "56")
    finally:
        holder.kill()
        holder.wait()


def test_ranks_that_outlive_their_killed_launcher_still_hold_the_run_dir(tmp_path: Path) -> None:
    from rlbatch.runtime.rundir import RunDir

    run = RunDir(tmp_path)
    run.logs.mkdir()
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", "rlbatch.worker", str(tmp_path)])
    try:
        (tmp_path / "logs" / "rank0.status").write_text(json.dumps(
            {"rank": 0, "state": "running", "pid": rank.pid, "host": socket.gethostname()}))
        assert f"rank 0 (pid {rank.pid}) still run on this host" in in_a_child(tmp_path)
    finally:
        rank.kill()
        rank.wait()
    assert in_a_child(tmp_path) == "ok"  # its status still says running: the pid is what counts
