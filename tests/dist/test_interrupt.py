"""Ctrl-C on a local run: the step in progress finishes, a checkpoint of it is saved, every rank
ends, the launcher exits 4 (interrupted, saved) without a traceback, and the same command
resumes from there (local mpiexec, CPU).

The launcher runs in a process group of its own and the test sends SIGINT to that whole group,
as a terminal's Ctrl-C does to its foreground group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbatch.errors import ExitCode
from rlbatch.launch.interrupt import processes_naming as processes_of
from tests.dist.test_resume import RUN, rows, run

pytestmark = pytest.mark.dist

STEPS = 6


def test_ctrl_c_saves_the_step_in_progress_and_resume_finishes_the_run(run_root: Path, cli_env: dict[str, str]) -> None:
    d = run_root / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "rlbatch.launch", f"run_dir={d}", *RUN, f"steps={STEPS}"],
                                cwd=run_root, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ((d / "metrics.jsonl").exists() and (logged := len(rows(d))) >= 1):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not log its first step"
            time.sleep(0.05)
        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        out, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == ExitCode.INTERRUPTED, out[-3000:] + err[-3000:]
    assert "Traceback" not in out + err, out[-3000:] + err[-3000:]
    assert "press Ctrl-C again to stop now" in err and "interrupted after saving a checkpoint (exit code 4)" in err
    # mpiexec runs in a session of its own and never sees the Ctrl-C (Hydra would answer it itself,
    # sending its own SIGINT to every rank and printing "[mpiexec@host] Press Ctrl-C again to force abort").
    assert "[mpiexec@" not in out + err, out[-3000:]
    assert processes_of(d) == [], "no process of the run outlives the launcher"
    # The step running when the signal came (or the next, had it just begun) is the last one.
    stopped = [r["step"] for r in rows(d)]
    assert stopped == list(range(len(stopped))) and logged <= stopped[-1] <= logged + 1 < STEPS - 1, (logged, stopped)
    assert f"stopping after step {stopped[-1]}: signal SIGINT; checkpoint saved" in out
    ckpts = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert ckpts == [f"step_{stopped[-1]:06d}"], ckpts
    assert (d / "checkpoints" / ckpts[0] / "manifest.json").is_file()

    again = run(d, f"steps={STEPS}")
    assert again.returncode == ExitCode.FINISHED, again.stderr[-3000:]
    assert f"resuming from {d / 'checkpoints' / ckpts[0]} (step {stopped[-1]})" in again.stdout
    assert [r["step"] for r in rows(d)] == list(range(STEPS)), "no step lost, none repeated"
