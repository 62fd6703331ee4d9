"""cluster=local: start every rank on this machine with mpiexec and wait for them.

The console shows the controller's output and any rank's fatal error (with its rank and roles);
each rank's full log is in <run_dir>/logs/. When the run fails, the ranks that caused it are
named from their status files.
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlbatch.errors import ConfigError
from rlbatch.launch.rundir import prepare_run_dir
from rlbatch.placement import Placement
from rlbatch.runtime.env import MPI_ENV
from rlbatch.runtime.postmortem import culprits
from rlbatch.runtime.rundir import RunDir


def find_mpiexec(configured: str) -> str:
    """cluster.mpiexec, else the mpiexec installed beside this Python (the mpich wheel), else PATH."""
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise ConfigError(f"cluster.mpiexec: {configured!r} is not an executable")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise ConfigError("cluster.mpiexec: no mpiexec beside this Python or on PATH; pip install mpich, or set cluster.mpiexec")
    return found


def mpiexec_command(cfg: Any, placement: Placement, run_dir: Path) -> list[str]:
    mpiexec = find_mpiexec(str(cfg.cluster.mpiexec or ""))
    return [mpiexec, "-n", str(placement.world_size), *map(str, cfg.cluster.mpiexec_args),
            sys.executable, "-u", "-m", "rlbatch.worker", str(run_dir)]


def run_local(cfg: Any, placement: Placement) -> int:
    run = prepare_run_dir(cfg, placement)
    cmd = mpiexec_command(cfg, placement, run.path)
    env = dict(os.environ) | MPI_ENV
    env.update({str(k): str(v) for k, v in cfg.cluster.env.items()})
    env["RLBATCH_JOB_ID"] = f"local-{os.getpid()}-{time.time_ns()}"
    env.setdefault("OMP_NUM_THREADS", str(cfg.cluster.cpus_per_task))
    print(f"run_dir: {run.path}  (rank logs in {run.logs})", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first = tee_and_watch(proc, run, placement.world_size)
    rc = proc.wait()
    if rc != 0:
        print(f"\nrlbatch: the run failed (mpiexec exit code {rc}).", file=sys.stderr)
        for line in culprits(placement, run, first):
            print(f"  {line}", file=sys.stderr)
    return rc


def tee_and_watch(proc: subprocess.Popen[bytes], run: RunDir, world_size: int) -> list[int]:
    """Pass mpiexec's output through unchanged (progress bars included) while watching every
    rank's process through a pidfd; return the ranks whose process ended first.

    When a rank is killed, mpiexec kills all others within milliseconds, and afterwards they
    all look alike. A pidfd becomes readable the moment its process exits, so the ranks seen
    in the first round of exits are the ones to blame (usually exactly one).
    """
    assert proc.stdout is not None
    out_fd, out = proc.stdout.fileno(), sys.stdout.buffer
    sel = selectors.DefaultSelector()
    sel.register(out_fd, selectors.EVENT_READ, None)
    watched: set[int] = set()
    first: list[int] = []
    next_scan = 0.0
    while True:
        if time.monotonic() >= next_scan and len(watched) < world_size:
            next_scan = time.monotonic() + 0.2
            for rank in set(range(world_size)) - watched:
                st = run.read_status(rank)
                if st is not None:
                    watched.add(rank)
                    try:
                        sel.register(os.pidfd_open(int(st["pid"])), selectors.EVENT_READ, rank)
                    except (ProcessLookupError, OSError):
                        pass  # gone already, or no pidfd support (Linux < 5.3)
        exited = []
        for key, _ in sel.select(timeout=0.2):
            if key.data is None:
                chunk = os.read(out_fd, 1 << 16)
                if not chunk:
                    return first
                out.write(chunk)
                out.flush()
            else:
                exited.append(key.data)
                sel.unregister(key.fd)
                os.close(key.fd)
        if exited and not first:
            first = sorted(exited)
