"""The Placement: which process runs which role on which GPU. Computed once, read by everyone.

A Placement is plain frozen data. ``place()`` (in ``place.py``) builds it; the launcher turns it
into an sbatch request or an mpiexec command, every rank finds itself in ``processes``, and the
world builder carves process groups from ``roles``. Nothing downstream re-derives placement.

Process numbering: world rank r < num_gpus is GPU rank r (so device_mapping values are torch
ranks); CPU workers follow in role order; the controller is the last rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from functools import cached_property
from typing import Any

from rlbatch.engines.registry import engine_args
from rlbatch.placement.backend import BackendSpec

CONTROLLER = "controller"


class ProcessKind(str, Enum):
    GPU = "gpu"
    CPU = "cpu"
    CONTROLLER = "controller"


@dataclass(frozen=True)
class RolePlacement:
    """One enabled role."""

    name: str
    backend: BackendSpec | None
    """None for CPU roles."""
    gpu_ranks: tuple[int, ...]
    """Its device_mapping, in order (empty for CPU roles)."""
    num_gpus_per_worker: int
    """0 for CPU roles."""
    world_size: int
    """Number of workers."""
    workers: tuple[tuple[int, ...], ...]
    """GPU ranks of each worker (consecutive slices of gpu_ranks); for CPU roles, the world rank
    of each worker as a 1-tuple."""
    nodes: tuple[int, ...]
    """Node of each worker's first rank (CPU workers: the node it was spread to)."""
    mesh: tuple[tuple[str, int], ...]
    """Named axes of the role's DeviceMesh, outermost first (empty for CPU roles). Training
    engines: (pp, dp, cp, tp) over all of gpu_ranks; inference: (dp, pp, tp) where dp counts
    engine instances."""
    colocated_with: tuple[str, ...]
    """Other roles that share at least one GPU with this one."""
    offload: bool
    engine_args: dict[str, Any]
    """As the config wrote them (what ``placement.json`` keeps); ``args`` types them."""

    @cached_property
    def args(self) -> object:
        """The role's typed engine_args: its engine's args dataclass, defaults filled in (None for a
        CPU role). Validated before launch; ValueError if they do not parse."""
        return engine_args(self.engine, self.engine_args) if self.backend is not None else None

    @property
    def is_gpu(self) -> bool:
        return self.backend is not None

    @property
    def engine(self) -> str:
        return self.backend.engine if self.backend else "cpu"


@dataclass(frozen=True)
class ProcessSlot:
    """One OS process of the job."""

    world_rank: int
    kind: ProcessKind
    node: int
    local_rank: int
    """Index of this process among the processes of its node (SLURM_LOCALID under srun)."""
    gpu_rank: int | None
    """GPU rank for kind=gpu."""
    local_gpu: int | None
    """Device index on its node for kind=gpu."""
    roles: tuple[tuple[str, int], ...]
    """(role, worker index) for every role this process serves."""


@dataclass(frozen=True)
class SlurmRequest:
    """What one sbatch job asks for. Every node gets the same task count (srun's block layout);
    slots beyond ``processes`` are spares that exit at once."""

    nodes: int
    ntasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int

    @property
    def ntasks(self) -> int:
        return self.nodes * self.ntasks_per_node


@dataclass(frozen=True)
class Placement:
    gpus_per_node: int
    num_nodes: int
    num_gpus: int
    roles: dict[str, RolePlacement]
    processes: tuple[ProcessSlot, ...]
    """Indexed by world rank."""
    colocated_sets: tuple[tuple[str, ...], ...]
    """Groups of roles that share GPUs (connected through shared ranks); singletons omitted."""
    slurm: SlurmRequest

    @property
    def world_size(self) -> int:
        return len(self.processes)

    @property
    def controller_rank(self) -> int:
        return len(self.processes) - 1

    def role(self, name: str) -> RolePlacement:
        return self.roles[name]

    def roles_on_gpu(self, gpu_rank: int) -> tuple[str, ...]:
        return tuple(name for name, _ in self.processes[gpu_rank].roles)

    def slot_at(self, node: int, local_rank: int) -> ProcessSlot | None:
        """The process srun starts as task ``local_rank`` on ``node``; None for a spare slot."""
        for p in self.processes:
            if p.node == node and p.local_rank == local_rank:
                return p
        return None

    def to_dict(self) -> dict[str, Any]:
        roles = {}
        for name, r in self.roles.items():
            d = asdict(r)
            d["backend"] = r.backend.to_dict() if r.backend else None
            d["engine"] = r.engine
            d["mesh"] = dict(r.mesh)
            roles[name] = d
        procs = []
        for p in self.processes:
            d = asdict(p)
            d["kind"] = p.kind.value
            d["roles"] = [list(x) for x in p.roles]
            procs.append(d)
        return {
            "gpus_per_node": self.gpus_per_node,
            "num_nodes": self.num_nodes,
            "num_gpus": self.num_gpus,
            "world_size": self.world_size,
            "controller_rank": self.controller_rank,
            "roles": roles,
            "processes": procs,
            "colocated_sets": [list(s) for s in self.colocated_sets],
            "slurm": asdict(self.slurm) | {"ntasks": self.slurm.ntasks},
        }
