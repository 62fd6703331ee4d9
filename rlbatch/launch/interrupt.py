"""Ctrl-C and SIGTERM during a local run: stop after the step in progress with a checkpoint;
the same again: stop now.

mpiexec and the ranks run in a session of their own, so a terminal's Ctrl-C (SIGINT to the whole
foreground process group) reaches the launcher alone, and the launcher decides:

- first Ctrl-C or SIGTERM: SIGINT to the controller rank, which records it like the preemption
  signal, finishes its step, saves a checkpoint and ends the run (``rlbatch.loop.preemption``;
  exit code 4, ``rlbatch.errors.ExitCode``);
- second: SIGTERM to every process of the run, SIGKILL to whatever is left STOP_GRACE_S later
  (exit code 130), with one line saying so;
- the preemption signal (``cluster.preempt_signal``) sent to the launcher is passed on to the
  controller unchanged: the run saves and stops as it would under Slurm (exit code 3).

Should the launcher itself die (SIGKILL, a closed terminal), the kernel sends mpiexec SIGTERM
(PR_SET_PDEATHSIG), and mpiexec ends the ranks: no rank outlives its launcher.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from rlbatch.osinfo import process_cmdline
from rlbatch.runtime.rundir import RunDir

STOP_GRACE_S = 5.0
"""After a second Ctrl-C: how long the run's processes have to end on SIGTERM before SIGKILL."""
FORWARD_POLL_S = 0.1
"""How often a stop request waits for the controller rank to start (a Ctrl-C during start-up)."""
PR_SET_PDEATHSIG = 1


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, from /proc/<pid>/task/<tid>/children (empty when gone)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except (OSError, ValueError):
                continue
            todo.extend(kids - found)
            found |= kids
    return found


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_in_own_session(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start mpiexec in a new session (out of the terminal's reach; Hydra gives each rank a session
    of its own too) with its output piped, no terminal input, and SIGTERM should the launcher die."""
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)


def step_in_progress(run: RunDir, since: float) -> int | None:
    """The step the run is in: one past the last row this launch wrote to metrics.jsonl (the
    controller rewrites it when it resumes); None before the first step of this launch."""
    path = run.path / "metrics.jsonl"
    try:
        if path.stat().st_mtime < since:
            return None
        lines = path.read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) + 1 if lines else None
    except (OSError, ValueError, KeyError, IndexError):
        return None


def last_checkpoint(run: RunDir) -> str:
    """The newest complete checkpoint's path (a ``step_<n>`` with a manifest), or 'none yet'."""
    from rlbatch.checkpoint.store import CheckpointError, read_manifest

    steps = [p for p in (run.path / "checkpoints").glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    for path in sorted(steps, key=lambda p: int(p.name[5:]), reverse=True):
        try:
            read_manifest(path)
        except CheckpointError:
            continue
        return str(path)
    return "none yet"


class StopRequests:
    """The launcher's signal handlers for one local run (a context manager around it)."""

    def __init__(self, run: RunDir, controller_rank: int, preempt_signal: str) -> None:
        self.run, self.controller_rank = run, controller_rank
        self.preempt = getattr(signal, f"SIG{preempt_signal}")
        self.proc: subprocess.Popen[bytes] | None = None
        self.asked = 0
        """Ctrl-Cs and SIGTERMs received."""
        self.stopped_now = False
        """The launcher ended the run's processes itself."""
        self.started = time.time()
        self._previous: dict[int, Any] = {}
        self._closed = False
        self._members: dict[int, str] = {}
        """pid -> start time of every process of the run seen so far (a pid reused later is not ours)."""

    def __enter__(self) -> StopRequests:
        stops = {signal.SIGINT, signal.SIGTERM}
        for sig in (*stops, *({self.preempt} - stops)):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._closed = True
        if kind is not None and self.proc is not None and self.proc.poll() is None:
            self.stop_now()  # the launcher is failing: take the run down with it
        self.reap()

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.proc = start_in_own_session(cmd, env)
        return self.proc

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum not in (signal.SIGINT, signal.SIGTERM):
            self._say(f"{signal.Signals(signum).name}: the run saves a checkpoint after {self._step()} and stops "
                      f"(preemption)")
            self._forward(signum)
            return
        self.asked += 1
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        if self.asked == 1:
            self._say(f"{name}: stopping after {self._step()} and saving a checkpoint; "
                      f"{'press Ctrl-C' if signum == signal.SIGINT else 'send SIGTERM'} again to stop now")
            self._forward(signal.SIGINT)
        elif not self.stopped_now:
            self._say(f"{name} again: stopping now, without saving (newest checkpoint: {last_checkpoint(self.run)})")
            self.stop_now()
        else:
            self._kill(signal.SIGKILL)

    def _say(self, line: str) -> None:
        # On a line of its own, after the controller's progress bar.
        sys.stderr.write(f"\nrlbatch: {line}\n")
        sys.stderr.flush()

    def _step(self) -> str:
        step = step_in_progress(self.run, self.started)
        return f"step {step}" if step is not None else "the first step"

    def _forward(self, signum: int) -> None:
        """Send ``signum`` to the controller rank once it runs (a thread waits for it to start)."""
        threading.Thread(target=self._forward_when_running, args=(signum,), daemon=True).start()

    def _forward_when_running(self, signum: int) -> None:
        while not (self._closed or self.stopped_now or (self.proc is not None and self.proc.poll() is not None)):
            pid = self._controller_pid() if self.proc is not None else None
            if pid is not None:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
                return
            time.sleep(FORWARD_POLL_S)

    def _controller_pid(self) -> int | None:
        """The controller rank's pid once it has reported itself running (its handlers are in
        place then), and only if mpiexec started it: the status file may be a previous launch's,
        and its pid someone else's by now."""
        assert self.proc is not None
        st = self.run.read_status(self.controller_rank)
        if st is None or st.get("state") != "running":
            return None
        pid = int(st["pid"])
        return pid if pid in descendants(self.proc.pid) else None

    def stop_now(self) -> None:
        """SIGTERM to every process of the run; SIGKILL to what is left after STOP_GRACE_S."""
        self.stopped_now = True
        self._kill(signal.SIGTERM)
        timer = threading.Timer(STOP_GRACE_S, self._escalate)
        timer.daemon = True
        timer.start()

    def _escalate(self) -> None:
        if self._alive():
            self._kill(signal.SIGKILL)

    def _kill(self, signum: int) -> None:
        if self.proc is None:
            return
        # Every process below mpiexec, remembered from the first call: a rank whose parent (Hydra's
        # proxy) died first is no longer below mpiexec, but still the run's.
        for pid in descendants(self.proc.pid) | {self.proc.pid}:
            if pid not in self._members and (started := _start_time(pid)) is not None:
                self._members[pid] = started
        for pid, started in self._members.items():
            if _start_time(pid) == started:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def reap(self) -> None:
        """After mpiexec ended: when the launcher stopped the run, wait for the rest of its
        processes to go (SIGKILL after STOP_GRACE_S), so none outlives the launcher."""
        if self.proc is None or not self.stopped_now:
            return
        for last_resort in (signal.SIGKILL, None):
            deadline = time.monotonic() + STOP_GRACE_S
            while self._alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not self._alive() or last_resort is None:
                return
            self._kill(last_resort)

    def _alive(self) -> bool:
        return any(_running(pid, started) for pid, started in self._members.items())


def _stat(pid: int | str) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, ... (field n at n - 3)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), None when it is gone or a zombie."""
    try:
        fields = _stat(pid)
    except (OSError, IndexError):
        return None
    return fields[19] if fields[0] != "Z" else None


def _running(pid: int, started: str) -> bool:
    """The same process is still there, and not a zombie (gone for every purpose but its parent's wait)."""
    return _start_time(pid) == started



def processes_naming(path: Path) -> list[int]:
    """Live processes (zombies aside) other than this one whose command line names ``path``: the
    mpiexec and every rank of a local run name its run directory."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmdline = process_cmdline(int(entry.name))
        try:
            if cmdline and str(path) in cmdline and _stat(entry.name)[0] != "Z":
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found
