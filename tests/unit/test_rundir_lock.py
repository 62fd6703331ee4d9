"""One run per run directory: the lock a launch takes before it writes anything, and the lock a
Slurm job takes when it starts (rlbatch.launch.joblock)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlbatch.runtime.rundir import LOCK, holder_text, lock_run_dir
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


# -- the Slurm job's side: the job takes the lock when it starts (rlbatch.launch.joblock) ----------
def take(run_dir: Path, job: str, wait_s: float = 0.0) -> dict:
    """``take_for_job`` on a descriptor of this process's own (as the batch shell's would be)."""
    from rlbatch.launch.joblock import take_for_job

    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        return dict(take_for_job(run_dir, fd, job, wait_s=wait_s))
    finally:
        os.close(fd)  # lets go of the kernel's lock: each test takes it once


@pytest.mark.parametrize("earlier", [
    {"host": "login1", "pid": None},  # the submitter's hand-over
    {"host": "node-b", "pid": 4242},  # the job's earlier incarnation, before a requeue, on another node
])
def test_a_job_takes_over_a_record_of_its_own_job_id(tmp_path: Path, earlier: dict) -> None:
    record(tmp_path, slurm_job="77", **earlier)
    rec = take(tmp_path, "77")
    assert (rec["slurm_job"], rec["pid"], rec["host"]) == ("77", os.getppid(), socket.gethostname())
    assert json.loads((tmp_path / LOCK).read_text()) == rec  # the batch shell (the taker's parent) holds it


def test_a_job_refuses_at_once_a_run_dir_another_live_job_holds(tmp_path: Path, squeue) -> None:
    from rlbatch.runtime.rundir import RunDirBusy

    squeue("RUNNING")
    record(tmp_path, host="node-b", pid=4242, slurm_job="78")
    before = (tmp_path / LOCK).read_text()
    t0 = time.monotonic()
    with pytest.raises(RunDirBusy) as e:
        take(tmp_path, "77", wait_s=30)
    assert time.monotonic() - t0 < 10, "another job's record is not waited for"
    assert f"run_dir {tmp_path} is in use by another run: pid 4242 on host node-b, Slurm job 78" in str(e.value)
    assert "(Slurm reports the job RUNNING)" in str(e.value)
    assert (tmp_path / LOCK).read_text() == before  # the holder's record is left as it was


@pytest.mark.parametrize("state", ["COMPLETED", "gone"])
def test_a_job_takes_over_the_stale_record_of_a_finished_job(tmp_path: Path, squeue, state: str) -> None:
    squeue(state)
    record(tmp_path, host="node-b", pid=4242, slurm_job="76")
    assert take(tmp_path, "77")["slurm_job"] == "77"


def test_a_job_refuses_at_once_a_live_local_launch(tmp_path: Path) -> None:
    from rlbatch.runtime.rundir import RunDirBusy

    holder = hold(tmp_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunDirBusy) as e:
            take(tmp_path, "77", wait_s=30)
        assert time.monotonic() - t0 < 10
    finally:
        holder.kill()
        holder.wait()
    assert e.value.held and f"pid {holder.pid} on host {socket.gethostname()}" in str(e.value)


def test_a_job_waits_for_its_earlier_incarnation_to_let_go(tmp_path: Path) -> None:
    earlier = hold(tmp_path, "77")  # still holds the kernel's lock (a dying batch shell)
    threading.Timer(1.0, earlier.kill).start()
    t0 = time.monotonic()
    assert take(tmp_path, "77", wait_s=30)["slurm_job"] == "77"
    assert 0.9 < time.monotonic() - t0 < 20
    earlier.wait()


def test_a_job_refuses_an_earlier_incarnation_that_keeps_the_lock(tmp_path: Path) -> None:
    from rlbatch.runtime.rundir import RunDirBusy

    earlier = hold(tmp_path, "77")
    try:
        with pytest.raises(RunDirBusy) as e:
            take(tmp_path, "77", wait_s=1.5)
    finally:
        earlier.kill()
        earlier.wait()
    assert f"still locked by this job's earlier incarnation (pid {earlier.pid} on host" in str(e.value)
    assert "then requeue it (scontrol requeue 77)" in str(e.value)


SUBMIT = """
import sys, time
from pathlib import Path
from rlbatch.runtime.rundir import lock_run_dir
lock = lock_run_dir(Path(sys.argv[1]))
lock.submitting()
print("submitting", flush=True)
time.sleep(1.0)  # sbatch, then the job id
lock.hand_over(sys.argv[2])
time.sleep(600)
"""


@pytest.mark.parametrize(("submitted", "taken"), [("77", True), ("78", False)])
def test_a_job_started_before_its_submitter_hands_over_waits_for_it(tmp_path: Path, squeue, submitted: str,
                                                                     taken: bool) -> None:
    from rlbatch.runtime.rundir import RunDirBusy

    squeue("PENDING")  # job 78, when the submitter handed the run_dir to it
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    submitter = subprocess.Popen([sys.executable, "-c", SUBMIT, str(tmp_path), submitted], stdout=subprocess.PIPE,
                                 text=True, env=env)
    try:
        assert submitter.stdout is not None and submitter.stdout.readline().strip() == "submitting"
        if taken:
            assert take(tmp_path, "77", wait_s=30)["slurm_job"] == "77"
        else:
            # (at the hand-over, or just after it: the record names job 78, which Slurm has queued)
            with pytest.raises(RunDirBusy, match=r"in use by another run: Slurm job 78 \(submitted from host "):
                take(tmp_path, "77", wait_s=30)
    finally:
        submitter.kill()
        submitter.wait()


JOB_SCRIPT = """
exec {RLBATCH_LOCK_FD}<>"$1/rlbatch.lock" || exit 1
"$PYTHON" -m rlbatch.launch.joblock "$1" "$RLBATCH_LOCK_FD" || exit $?
echo started
sleep 600
"""


def job_shell(run_dir: Path, job: str) -> subprocess.Popen[str]:
    """A batch shell's first lines, as the sbatch script has them: the lock, then (here) a sleep."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHON=sys.executable, SLURM_JOB_ID=job)
    return subprocess.Popen(["bash", "-c", JOB_SCRIPT, "job", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_the_batch_shell_holds_the_lock_for_the_jobs_life_and_a_second_job_is_refused_by_name(tmp_path: Path) -> None:
    first = job_shell(tmp_path, "77")
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "started"
        rec = json.loads((tmp_path / LOCK).read_text())
        assert (rec["pid"], rec["slurm_job"]) == (first.pid, "77")  # the shell, not the exited helper
        # The helper has exited; the shell's descriptor holds the kernel's lock.
        assert f"pid {first.pid} on host {socket.gethostname()}, Slurm job 77" in in_a_child(tmp_path)
        second = job_shell(tmp_path, "78")
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2 and "started" not in out, err
        assert err.splitlines()[0] == (f"rlbatch: Slurm job 78 cannot start: run_dir {tmp_path} is in use by another "
                                       f"run: {holder_text(rec)}. Wait for that run to end, stop it, or choose another "
                                       f"run_dir (nothing of it was touched)")
    finally:
        first.kill()
        first.wait()
    assert in_a_child(tmp_path) == "ok"  # the job's shell has ended: its lock with it


def test_the_submitter_reports_a_job_refused_at_its_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from rlbatch.launch import slurm
    from rlbatch.runtime.rundir import RunDir

    monkeypatch.setattr(slurm, "_squeue", lambda job: ("", ""))
    run = RunDir(tmp_path)
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "78_0_log.out").write_text(
        f"rlbatch: Slurm job 78 cannot start: run_dir {tmp_path} is in use by another run: pid 9 on host n1\n")
    placement = SimpleNamespace(world_size=1, controller_rank=0)
    run.write_status(0, "exited", code=0)  # the other run's: not this job's outcome
    assert slurm.follow("78", run, placement, poll_s=0) == 2  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert f"job 78: refused\n  Slurm job 78 cannot start: run_dir {tmp_path} is in use" in err
