"""Two launches into one run directory: the second is refused before it starts, naming the first
(host, pid) and what to do, and touches none of its files; once the first is killed with SIGKILL
(launcher, mpiexec and ranks: a crashed job), its lock does not block the next launch.

Where a Slurm cluster answers (the dev cluster: slurm/dev-cluster.sh; run_dir must be on a
filesystem its nodes see, as the default --work is), a Slurm job submitted by hand into the same
run directory while the first run trains (cluster=slurm's own sbatch script, given to sbatch
around the launcher's check) ends at its start with exit code 2, naming the first run.

    python tools/faults.py --only two_launches

Before the fix both ran: metrics interleaved, rank logs were shared, and one checkpoint directory
was left without a manifest. CI tests the same in tests/unit/test_rundir_lock.py and
tests/slurm/test_slurm_rundir_lock.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

RUN = ["algo.prompts_per_step=8", "algo.samples_per_prompt=4"]

Check = tuple[str, bool, str]


def start(run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "rlbatch.launch", f"run_dir={run_dir}", *RUN, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def digest(run_dir: Path) -> dict[str, str]:
    """The first run's files that a second launch would overwrite."""
    return {n: hashlib.sha256((run_dir / n).read_bytes()).hexdigest()[:12] for n in ("config.yaml", "placement.json")}


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # its process group: launcher, mpiexec, every rank
    proc.wait()


def slurm_up() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(st.rstrip("*") in ("idle", "mix", "alloc") for st in out.stdout.split())


def slurm_job_into(run: Path, work: Path, holder: int) -> Check:
    """A Slurm job submitted by hand into ``run`` while ``holder`` (the first launch) holds it."""
    what = "a Slurm job submitted by hand into it ends at its start: exit 2, naming the holder"
    if not slurm_up():
        return what, True, "not run: no Slurm cluster answers here (sudo bash slurm/dev-cluster.sh start)"
    from rlbatch.checks.validate import check
    from rlbatch.config.compose import compose
    from rlbatch.launch.slurm import sbatch_script

    cfg = compose(["program=selftest", "cluster=slurm", "cluster.cpus_per_task=1", f"run_dir={run}"])
    script = work / "by_hand.sbatch"
    script.write_text(sbatch_script(cfg, check(cfg, runnable=False), run))
    (run / "slurm").mkdir(exist_ok=True)  # the job log's folder (the launcher makes it before it submits)
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={work}", str(script)], capture_output=True, text=True)
    if sub.returncode != 0:
        return what, False, f"sbatch refused it: {sub.stderr.strip()}"
    job, t0, rec = sub.stdout.strip().split(";")[0], time.monotonic(), {}
    while time.monotonic() - t0 < 120 and rec.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        time.sleep(0.2)  # slurmctld forgets an ended job after MinJobAge: watch it closely
        out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
        rec = dict(f.split("=", 1) for f in out.split() if "=" in f) or rec
    log = run / "slurm" / f"{job}_0_log.out"
    refusal = next((ln for ln in (log.read_text() if log.exists() else "").splitlines() if "cannot start" in ln), "")
    ok = rec.get("ExitCode") == "2:0" and f"pid {holder} on host {socket.gethostname()}" in refusal
    return what, ok, f"job {job} {rec.get('JobState', '?')}, exit code {rec.get('ExitCode', '?')}: {refusal or log}"


def scenario(work: Path) -> list[Check]:
    checks: list[Check] = []
    run = work / "run"
    subprocess.run(["rm", "-rf", str(run)])
    first = start(run, "steps=500")
    second: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        checks.append(("the first launch is training", first.poll() is None and (run / "metrics.jsonl").exists(),
                       f"pid {first.pid}"))
        before, logs_before = digest(run), sorted(p.name for p in (run / "logs").iterdir())
        t0 = time.monotonic()
        second = start(run, "steps=3")
        out, err = second.communicate(timeout=120)
        took = time.monotonic() - t0
        refusal = next((ln.strip() for ln in err.splitlines() if "in use by another run" in ln), err[-300:])
        checks.append(("the second is refused: exit 2", second.returncode == 2, f"exit code {second.returncode} in {took:.1f} s"))
        checks.append(("... naming the holder's host and pid", f"pid {first.pid} on host {socket.gethostname()}" in refusal,
                       refusal))
        checks.append(("... before it starts anything", "run_dir:" not in out and "mpiexec" not in out,
                       "no 'run_dir:' line (the local launcher prints it when it starts mpiexec)"))
        checks.append(("... touching none of the first run's files",
                       digest(run) == before and sorted(p.name for p in (run / "logs").iterdir()) == logs_before,
                       f"config.yaml, placement.json {before}; logs {logs_before}"))
        checks.append(slurm_job_into(run, work, first.pid))
        checks.append(("... and after that job, still none of them",
                       digest(run) == before and sorted(p.name for p in (run / "logs").iterdir()) == logs_before,
                       f"config.yaml, placement.json {before}; logs {logs_before}"))
        checks.append(("the first run goes on", first.poll() is None, "still running"))
        stop(first)
        t0 = time.monotonic()
        third = start(run, "steps=1", "resume=never")
        out, err = third.communicate(timeout=300)
        checks.append(("after SIGKILL of the first, a launch runs (stale lock)", third.returncode == 0,
                       f"exit code {third.returncode} in {time.monotonic() - t0:.1f} s" + ("" if third.returncode == 0 else f": {err[-300:]}")))
    finally:
        stop(first)
        if second is not None:
            stop(second)
    return checks
