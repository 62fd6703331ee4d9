"""Ctrl-C on a local run: the step in progress finishes and is checkpointed, every rank ends, the
launcher exits 4; the same command resumes and loses nothing (its metrics and exported weights
equal an uninterrupted run's). A second Ctrl-C stops at once (exit 130, no process left), and the
preemption signal sent to the launcher saves and stops with exit code 3.

    python tools/faults.py --only ctrl_c

Each launch runs in a process group of its own, and Ctrl-C is SIGINT to that whole group, as a
terminal sends it. CI tests the same in tests/dist/test_interrupt.py and tests/unit/test_exit_codes.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlbatch.launch.interrupt import processes_naming as processes_of

RUN = ["algo.prompts_per_step=8", "algo.samples_per_prompt=4", "data.reward_fn=rlbatch.rewards.rules:format_reward"]
"""The small default experiment, with a reward that moves the weights from the first step."""
STEPS = 8
KEYS = ("reward_mean", "tokens/generated", "train/pg_loss", "train/grad_norm")

Check = tuple[str, bool, str]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def launch(run_dir: Path, signals: tuple[tuple[int, float], ...] = (), timeout: float = 300) -> tuple[int, str, str, float]:
    """``python -m rlbatch.launch`` in a process group of its own; after its first logged step,
    send each (signal, delay) to the group. Returns exit code, stdout, stderr and the seconds from
    the first signal to the exit (0 without signals)."""
    proc = subprocess.Popen([sys.executable, "-m", "rlbatch.launch", f"run_dir={run_dir}", *RUN, f"steps={STEPS}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    sent = 0.0
    try:
        if signals:
            deadline = time.monotonic() + timeout
            while not rows(run_dir) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            sent = time.monotonic()
            for sig, delay in signals:
                time.sleep(delay)
                os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, (time.monotonic() - sent) if signals else 0.0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in processes_of(run_dir):  # never leave anything of ours behind, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def export(run_dir: Path, out: Path) -> bytes:
    subprocess.run([sys.executable, "-m", "rlbatch.export", str(run_dir), str(out)], check=True, capture_output=True)
    return (out / "model.safetensors").read_bytes()


def checkpoints(run_dir: Path) -> list[str]:
    d = run_dir / "checkpoints"
    return sorted(p.name for p in d.iterdir() if (p / "manifest.json").is_file()) if d.is_dir() else []


def scenario(work: Path) -> list[Check]:
    checks: list[Check] = []
    for old in ("split", "whole", "now", "preempted", "e_split", "e_whole"):  # a fresh start, not a resume
        shutil.rmtree(work / old, ignore_errors=True)
    # Ctrl-C once, after the first step is logged.
    split = work / "split"
    code, out, err, secs = launch(split, ((signal.SIGINT, 0.0),))
    stopped = [r["step"] for r in rows(split)]
    last = stopped[-1] if stopped else -1
    checks.append(("Ctrl-C: exit code 4 (interrupted, checkpoint saved)", code == 4,
                   f"exit code {code}, {secs:.1f}s after Ctrl-C, after step {last} of {STEPS}"))
    checks.append(("Ctrl-C: checkpoint of the step in progress", checkpoints(split) == [f"step_{last:06d}"],
                   f"complete checkpoints {checkpoints(split)}; steps logged {stopped}"))
    checks.append(("Ctrl-C: no process of the run left", not processes_of(split), f"left: {processes_of(split)}"))
    said = [ln for ln in err.splitlines() if ln.startswith("rlbatch:")]
    checks.append(("Ctrl-C: what happens is said, no traceback", "Traceback" not in out + err and len(said) == 2,
                   " | ".join(said)))
    # The same command again resumes; an uninterrupted run of as many steps is the reference.
    code, out, err, _ = launch(split)
    resumed = [r["step"] for r in rows(split)]
    checks.append(("resume: finishes the remaining steps", code == 0 and resumed == list(range(STEPS)),
                   f"exit code {code}, steps {resumed}; {next((ln for ln in out.splitlines() if 'resuming from' in ln), '')}"))
    whole = work / "whole"
    code, _, _, _ = launch(whole)
    same_rows = [[r.get(k) for k in KEYS] for r in rows(split)] == [[r.get(k) for k in KEYS] for r in rows(whole)]
    same_weights = code == 0 and export(split, work / "e_split") == export(whole, work / "e_whole")
    checks.append(("resume loses nothing: equals an uninterrupted run", same_rows and same_weights,
                   f"per-step {', '.join(KEYS)} equal: {same_rows}; exported weights bitwise equal: {same_weights}"))
    # Ctrl-C twice: stop at once.
    now = work / "now"
    code, out, err, secs = launch(now, ((signal.SIGINT, 0.0), (signal.SIGINT, 0.5)))
    said = [ln for ln in err.splitlines() if ln.startswith("rlbatch:")]
    checks.append(("second Ctrl-C: stops at once, exit code 130", code == 130 and secs < 15,
                   f"exit code {code}, {secs:.1f}s after the first Ctrl-C"))
    checks.append(("second Ctrl-C: no process of the run left, no traceback",
                   not processes_of(now) and "Traceback" not in out + err, " | ".join(said)))
    # The preemption signal sent to the launcher: saved and stopped, told apart from a finished run.
    pre = work / "preempted"
    code, out, err, secs = launch(pre, ((signal.SIGUSR2, 0.0),))
    checks.append(("SIGUSR2 to the launcher: exit code 3 (preempted, checkpoint saved)",
                   code == 3 and len(checkpoints(pre)) == 1 and not processes_of(pre),
                   f"exit code {code}, checkpoints {checkpoints(pre)}, {secs:.1f}s after the signal"))
    return checks
