"""cluster=local: start every rank on this machine with mpiexec and wait for them.

The console shows the controller's output and any rank's fatal error (with its rank and roles);
each rank's full log is in <run_dir>/logs/. When the run fails, the ranks that caused it are
named from their status files. Ctrl-C stops the run after the step in progress with a
checkpoint, a second one at once (``rlbatch.launch.interrupt``); the exit code says how the run
ended (``rlbatch.launch.exit_codes``).
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbatch.checks.runnable import locate_mpiexec
from rlbatch.launch.exit_codes import ExitCode, run_exit_code
from rlbatch.launch.interrupt import StopRequests, descendants
from rlbatch.placement import Placement
from rlbatch.runtime.env import MPI_ENV, cpu_device_env, network_env
from rlbatch.runtime.postmortem import culprits
from rlbatch.runtime.rundir import RunDir, prepare_run_dir


def find_mpiexec(configured: str) -> str:
    """cluster.mpiexec, else the mpiexec installed beside this Python (the mpich wheel), else PATH.

    The same lookup validation runs (``locate_mpiexec``), so a config that passed finds one here."""
    return locate_mpiexec(configured)


def mpiexec_command(cfg: Any, placement: Placement, run_dir: Path) -> list[str]:
    mpiexec = find_mpiexec(str(cfg.cluster.mpiexec or ""))
    return [mpiexec, "-n", str(placement.world_size), *map(str, cfg.cluster.mpiexec_args),
            sys.executable, "-u", "-m", "rlbatch.worker", str(run_dir)]


def local_env(cfg: Any) -> dict[str, str]:
    """The environment mpiexec passes to every rank: this one, MPI's settings, the CPU device's,
    the network interface's (``cluster.network_interface``), ``cluster.env`` and a job id."""
    c = cfg.cluster
    env = dict(os.environ) | MPI_ENV | cpu_device_env(str(c.device)) | network_env(c.network_interface)
    env.update({str(k): str(v) for k, v in c.env.items()})
    env["RLBATCH_JOB_ID"] = f"local-{os.getpid()}-{time.time_ns()}"
    env.setdefault("OMP_NUM_THREADS", str(c.cpus_per_task))
    return env


def run_local(cfg: Any, placement: Placement) -> int:
    """Run every rank here and wait for them; returns the launcher's exit code (``ExitCode``).
    Ctrl-C stops the run after the step in progress with a checkpoint, a second one at once
    (``rlbatch.launch.interrupt``)."""
    run = prepare_run_dir(cfg, placement)
    cmd = mpiexec_command(cfg, placement, run.path)
    env = local_env(cfg)
    print(f"run_dir: {run.path}  (rank logs in {run.logs})", flush=True)
    with StopRequests(run, placement.controller_rank, str(cfg.cluster.preempt_signal)) as stops:
        proc = stops.start(cmd, env)
        first = tee_and_watch(proc, run, placement.world_size, muted=lambda: stops.stopped_now)
        rc = proc.wait()
    code = run_exit_code(rc == 0, run.read_status(placement.controller_rank), stops.stopped_now)
    if code == ExitCode.FAILED:
        print(f"\nrlbatch: the run failed (mpiexec exit code {rc}).", file=sys.stderr)
        for line in culprits(placement, run, first):
            print(f"  {line}", file=sys.stderr)
    elif code in (ExitCode.PREEMPTED, ExitCode.INTERRUPTED):
        print(f"rlbatch: {code.name.lower()} after saving a checkpoint (exit code {int(code)}); launch again with "
              f"run_dir={run.path} to resume.", file=sys.stderr)
    return int(code)


FIRST_WINDOW_S = 0.25
"""Processes that end this close after the first one are all candidates for the cause."""


def tee_and_watch(proc: subprocess.Popen[bytes], run: RunDir, world_size: int,
                  muted: Callable[[], bool] = lambda: False) -> list[int]:
    """Pass mpiexec's output through unchanged (progress bars included) while watching every
    process mpiexec starts through a pidfd; return the ranks whose process ended first. Output
    is dropped while ``muted()`` (the ranks' dying words after the user stopped the run).

    When a rank is killed, mpiexec kills all others within milliseconds, and afterwards they
    all look alike. A pidfd becomes readable the moment its process exits, so the ranks that
    end first are the ones to blame. Processes are
    found in /proc while the ranks are still importing (seconds before any of them can fail),
    and matched to ranks by the pid in their status files only when one ends.

    The launcher can stop the others before the kernel reports the first one gone (it sees the
    dead rank's sockets close a moment earlier), so every rank that ends within FIRST_WINDOW_S
    of the first counts; the post-mortem narrows them with what the surviving ranks reported.
    """
    assert proc.stdout is not None
    out_fd, out = proc.stdout.fileno(), sys.stdout.buffer
    sel = selectors.DefaultSelector()
    sel.register(out_fd, selectors.EVENT_READ, None)
    watched: set[int] = set()
    first_pids: list[int] = []
    first_at = 0.0
    scan_until = time.monotonic() + 600.0
    while True:
        exited: list[int] = []
        if time.monotonic() < scan_until and not first_pids:  # until every rank is watched
            for pid in descendants(proc.pid) - watched:
                watched.add(pid)
                try:
                    sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
                except ProcessLookupError:
                    exited.append(pid)
                except OSError:
                    pass  # no pidfd support (Linux < 5.3): the report falls back to status files
            if _all_ranks_watched(run, world_size, watched):
                scan_until = 0.0
        for key, _ in sel.select(timeout=0.05 if scan_until else 1.0):
            if key.data is None:
                chunk = os.read(out_fd, 1 << 16)
                if not chunk:
                    return _ranks_of(run, world_size, first_pids)
                if not muted():
                    out.write(chunk)
                    out.flush()
            else:
                exited.append(key.data)
                sel.unregister(key.fd)
                os.close(key.fd)
        now = time.monotonic()
        if exited and (not first_pids or now <= first_at + FIRST_WINDOW_S):
            first_at = first_at or now
            first_pids += exited


def _rank_pids(run: RunDir, world_size: int) -> dict[int, int]:
    pids = {}
    for rank in range(world_size):
        st = run.read_status(rank)
        if st is not None:
            pids[int(st["pid"])] = rank
    return pids


def _all_ranks_watched(run: RunDir, world_size: int, watched: set[int]) -> bool:
    pids = _rank_pids(run, world_size)
    return len(pids) == world_size and set(pids) <= watched


def _ranks_of(run: RunDir, world_size: int, pids: list[int]) -> list[int]:
    by_pid = _rank_pids(run, world_size)
    return [by_pid[pid] for pid in pids if pid in by_pid]  # in the order they ended
