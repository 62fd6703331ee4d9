"""Two launches into one run directory: the second is refused before it starts, naming the first
(host, pid) and what to do, and touches none of its files; once the first is killed with SIGKILL
(launcher, mpiexec and ranks: a crashed job), its lock does not block the next launch.

    python tools/faults.py --only two_launches

Before the fix both ran: metrics interleaved, rank logs were shared, and one checkpoint directory
was left without a manifest. CI tests the same in tests/unit/test_rundir_lock.py.
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
