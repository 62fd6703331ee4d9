"""A rank that hangs instead of dying: in a weight sync (the inference rank never joins the
broadcast) and in a generation. Each run ends with exit code 1 soon after ``cluster.timeout_s``,
and the report's first line names the rank, its role and the phase it hung in.

    python tools/faults.py --only hang

What ends it: the controller's wait for the phase (``cluster.timeout_s``), which names the ranks
that did not answer; the controller then aborts the job and the launcher stops every rank. In the
sync, the sender's broadcast also times out on its own side (the sync group has
``cluster.timeout_s`` too) and names its peer; a rank still in a phase at the timeout writes its
stacks to its log. Those two come within the controller's 3 s pause before it aborts, which a very
loaded machine can miss. CI tests the same in tests/dist/test_hang.py and
tests/unit/test_control_timeout.py.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlbatch.launch.interrupt import processes_naming

TIMEOUT_S = 20
RUN = ["roles=disaggregated", "steps=1", f"cluster.timeout_s={TIMEOUT_S}", "algo.prompts_per_step=8",
       "algo.samples_per_prompt=4"]
"""Ranks 0: actor_train + reference, 1: actor_infer (hf), 2: reward, 3: controller."""
MARGIN_S = 30
"""After the controller's wait: its 3 s pause, the launcher stopping every rank, the report."""

Check = tuple[str, bool, str]


def launch(run_dir: Path, fault: str) -> tuple[int, str, float]:
    """Run with ``fault``; exit code, stderr, and when the launcher exited (epoch seconds)."""
    subprocess.run(["rm", "-rf", str(run_dir)])
    proc = subprocess.Popen([sys.executable, "-m", "rlbatch.launch", f"run_dir={run_dir}", *RUN],
                            env=os.environ | {"RLBATCH_FAULT": fault}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
        return proc.returncode, err, time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in processes_naming(run_dir):  # nothing of ours left behind, whatever happened
            os.kill(pid, signal.SIGKILL)


def log_time(line: str) -> float:
    return datetime.datetime.strptime(" ".join(line.split()[:2]), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def status(run_dir: Path, rank: int) -> dict:
    path = run_dir / "logs" / f"rank{rank}.status"
    return json.loads(path.read_text()) if path.exists() else {}


def case(work: Path, name: str, fault: str, cause: str, phase: str, rank: int) -> list[Check]:
    run = work / name
    code, err, ended = launch(run, fault)
    report = [ln.strip() for ln in err[err.find("the run failed"):].splitlines()[1:] if ln.strip()]
    log = (run / "logs" / f"rank{rank}.log").read_text() if (run / "logs" / f"rank{rank}.log").exists() else ""
    injected = next((log_time(ln) for ln in log.splitlines() if f"injecting fault '{fault}'" in ln), None)
    took = ended - injected if injected is not None else float("nan")
    checks: list[Check] = [
        (f"{name}: {fault} ends the run with exit code 1", code == 1, f"exit code {code}"),
        (f"... within cluster.timeout_s + {MARGIN_S} s of the hang", took < TIMEOUT_S + MARGIN_S,
         f"ended {took:.1f} s after the rank hung (cluster.timeout_s={TIMEOUT_S})"),
        ("... the report's first line names the rank, its role and the phase",
         bool(report) and report[0].startswith(f"{cause} hung in {phase} "), report[0] if report else err[-500:]),
        ("... and the hung rank's log holds its stacks at the timeout (maybe_fault's sleep)",
         f"Timeout (0:00:{TIMEOUT_S})!" in log and "in maybe_fault" in log, f"logs/rank{rank}.log"),
    ]
    if phase.startswith("phase 'sync'"):
        sender, controller = status(run, 0), status(run, 3)
        collective = str(sender.get("error", ""))
        checks.append(("... the sender's broadcast timed out on its side, naming the group",
                       "CollectiveError" in collective and "group 'sync'" in collective,
                       f"{collective[:160]} ({float(sender.get('time', 0)) - float(controller.get('time', 0)):+.2f} s "
                       f"after the controller's timeout)"))
    return checks


def scenario(work: Path) -> list[Check]:
    infer = "rank 1 (actor_infer[0]; GPU rank 1, node 0)"
    return [*case(work, "sync", "hang:1:sync_recv", infer, "phase 'sync' of actor_train, actor_infer", 1),
            *case(work, "generate", "hang:1:generate", infer, "phase 'generate' of actor_infer", 1)]

