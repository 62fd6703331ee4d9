"""The one place that reads the scheduler's environment.

Every variable rlbatch reads from Slurm, PMI/MPI or its own local launcher is named in ``VARS``;
no other module touches ``os.environ`` for these. Pure: no torch, no MPI.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

VARS: dict[str, tuple[str, ...]] = {
    # field                 variables, first one set wins
    "job_id": ("SLURM_JOB_ID", "RLBATCH_JOB_ID"),
    "slurm_procid": ("SLURM_PROCID",),
    "slurm_localid": ("SLURM_LOCALID",),
    "slurm_nodeid": ("SLURM_NODEID",),
    "slurm_ntasks": ("SLURM_NTASKS",),
    "slurm_nodelist": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "slurm_restart_count": ("SLURM_RESTART_COUNT",),
    "slurm_job_start": ("SLURM_JOB_START_TIME",),
    "slurm_job_end": ("SLURM_JOB_END_TIME",),
    "mpi_rank": ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID"),
    "mpi_size": ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"),
    "pmi_fd": ("PMI_FD",),
    "run_dir": ("RLBATCH_RUN_DIR",),
    "master_addr": ("RLBATCH_MASTER_ADDR",),
    "lifeline": ("RLBATCH_LIFELINE",),  # the local launcher's socket each rank holds (runtime/lifeline.py)
    "cuda_visible_devices": ("CUDA_VISIBLE_DEVICES",),
    "fault": ("RLBATCH_FAULT",),  # tests only: '<kill|raise|hang|enospc>:<rank|r,s|*>[:<where>[:<nth>]]' (runtime/faults.py)
}


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for n in names:
        v = environ.get(n)
        if v not in (None, ""):
            return v
    return None


def _int(v: str | None) -> int | None:
    return int(v) if v is not None and v.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class SchedulerEnv:
    """What the scheduler told this process."""

    job_id: str | None
    slurm_procid: int | None
    slurm_localid: int | None
    slurm_nodeid: int | None
    slurm_ntasks: int | None
    slurm_nodelist: str | None
    slurm_restart_count: int
    slurm_job_start: int | None
    slurm_job_end: int | None
    mpi_rank: int | None
    mpi_size: int | None
    pmi_fd: int | None
    run_dir: str | None
    master_addr: str | None
    lifeline: str | None
    cuda_visible_devices: str | None
    fault: str | None

    @property
    def under_slurm(self) -> bool:
        """Started by srun (a Slurm task), not just inside an allocation."""
        return self.slurm_procid is not None and self.slurm_nodeid is not None

    @property
    def first_node(self) -> str | None:
        """Host name of the allocation's first node, where world rank 0 runs."""
        return expand_hostlist(self.slurm_nodelist)[0] if self.slurm_nodelist else None


def read_env(environ: Mapping[str, str] | None = None) -> SchedulerEnv:
    e = os.environ if environ is None else environ
    raw = {k: _first(e, names) for k, names in VARS.items()}
    ints = {"slurm_procid", "slurm_localid", "slurm_nodeid", "slurm_ntasks", "slurm_job_start",
            "slurm_job_end", "mpi_rank", "mpi_size", "pmi_fd"}
    values: dict[str, object] = {k: (_int(v) if k in ints else v) for k, v in raw.items()}
    values["slurm_restart_count"] = _int(raw["slurm_restart_count"]) or 0
    return SchedulerEnv(**values)  # type: ignore[arg-type]


_HOST_RE = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?")


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm host list: 'n[1-3,7],gpu[01-02]' -> ['n1','n2','n3','n7','gpu01','gpu02']."""
    hosts: list[str] = []
    pos = 0
    while pos < len(spec):
        m = _HOST_RE.match(spec, pos)
        if m is None:
            raise ValueError(f"cannot parse Slurm host list {spec!r} at {pos}")
        prefix, body = m.group(1), m.group(2)
        if body is None:
            hosts.append(prefix)
        else:
            for part in body.split(","):
                lo, _, hi = part.partition("-")
                if not hi:
                    hosts.append(prefix + lo)
                    continue
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        pos = m.end()
        if pos < len(spec) and spec[pos] == ",":
            pos += 1
    return hosts


MPI_ENV = {"MPIR_CVAR_NOLOCAL": "1"}
"""Environment every rank gets from the launchers. MPICH names its shared-memory segments after
the job and step ids, which a requeued Slurm job reuses: after an aborted attempt the stale
segment makes the next attempt's MPI_Init spin for ever (and aborted runs leak segments into
/dev/shm). MPI carries only the control plane's small messages, so it runs without shared memory."""

def network_env(interface: str | None) -> dict[str, str]:
    """Environment every rank gets for ``cluster.network_interface``: NCCL and gloo open their
    sockets on that interface (else each picks one itself, possibly one other nodes cannot reach)."""
    return {"NCCL_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface} if interface else {}


CPU_DEVICE_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
"""Environment of ranks whose "device" is the CPU: glibc keeps freed memory for reuse instead of
handing it back to the OS, as CUDA's caching allocator does on a GPU. An offload frees a state's
storage and the reload grows it again; with glibc's defaults every page of a large storage is
returned at the free and faults in again at the re-grow, which doubled the cost of an offload +
reload round trip (tools/bench/overheads.py). On the CPU an offload frees no memory that matters
anyway: the stash holds the same bytes in the same RAM. Read by glibc at process start, so the
launchers set it (it is not for GPU nodes, where the host's RSS should shrink after big frees)."""


def cpu_device_env(device: str) -> dict[str, str]:
    """CPU_DEVICE_ENV when ``cluster.device`` puts the ranks on the CPU: 'cpu', or 'auto' on a
    machine without NVIDIA devices (judged where the launcher runs: local runs only)."""
    from pathlib import Path

    if device == "cpu" or (device == "auto" and not any(Path("/dev").glob("nvidia[0-9]*"))):
        return dict(CPU_DEVICE_ENV)
    return {}
