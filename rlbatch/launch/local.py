"""cluster=local: start every rank on this machine with mpiexec and wait for them.

The console shows the controller's output and any rank's fatal error (with its rank and roles);
each rank's full log is in <run_dir>/logs/. When the run fails, the ranks that caused it are
named from their status files. Ctrl-C stops the run after the step in progress with a
checkpoint, a second one at once (``rlbatch.launch.interrupt``); the exit code says how the run
ended (``rlbatch.errors.ExitCode``).
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
from rlbatch.errors import ExitCode
from rlbatch.launch.exit_codes import run_exit_code
from rlbatch.launch.interrupt import StopRequests
from rlbatch.launch.rundir import prepare_run_dir
from rlbatch.placement import Placement
from rlbatch.runtime.env import MPI_ENV, cpu_device_env, network_env
from rlbatch.runtime.lifeline import ENV as LIFELINE_ENV
from rlbatch.runtime.lifeline import Lifelines
from rlbatch.runtime.postmortem import culprits


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
    with StopRequests(run, placement.controller_rank, str(cfg.cluster.preempt_signal)) as stops, \
            Lifelines(placement.world_size) as lifelines:
        proc = stops.start(cmd, env | {LIFELINE_ENV: lifelines.address})
        first = tee_and_watch(proc, lifelines, muted=lambda: stops.stopped_now)
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
"""Ranks whose lifelines end this close after the first one are all named, the first one first."""


def tee_and_watch(proc: subprocess.Popen[bytes], lifelines: Lifelines,
                  muted: Callable[[], bool] = lambda: False) -> list[int]:
    """Pass mpiexec's output through unchanged (progress bars included) while reading the ranks'
    lifelines (``rlbatch.runtime.lifeline``); return the ranks whose lifelines ended first, in
    the order they ended. Output is dropped while ``muted()`` (the ranks' dying words after the
    user stopped the run)."""
    assert proc.stdout is not None
    out_fd, out = proc.stdout.fileno(), sys.stdout.buffer
    with selectors.DefaultSelector() as sel:
        sel.register(out_fd, selectors.EVENT_READ, None)
        lifelines.register(sel)
        while True:
            for key, _ in sel.select():
                if lifelines.handle(key):
                    continue
                chunk = os.read(out_fd, 1 << 16)
                if not chunk:
                    sel.unregister(out_fd)
                    lifelines.drain(sel)
                    return lifelines.first(FIRST_WINDOW_S)
                if not muted():
                    out.write(chunk)
                    out.flush()
