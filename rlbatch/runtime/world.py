"""Build the world once: MPI communicators, torch process groups and DeviceMeshes per role.

Every process calls ``build_world`` with the same Placement, so every collective creation
happens in the same order everywhere. Spare Slurm slots get ``None`` and exit.

    control plane  MPI: ``comm`` (all processes, renumbered to world ranks) + one per role
    data plane     torch.distributed: the global group, one group per role, a DeviceMesh per GPU
                   role with named axes, and the actor_train -> actor_infer weight-sync group

A run none of whose engines needs torch.distributed (``EngineSpec.needs_torch_world``: False for
the ``sleep`` engines of ``tools/bench/scale.py``) and whose weight sync stays within each rank
(actor_infer's ranks among actor_train's) starts no torch.distributed world at all
(``needs_torch_world``): no groups, no meshes, no rendezvous, no gloo connections (a full mesh of
sockets per group); its samples move over MPI (``World.data_comm``, ``rlbatch.runtime.mpi_dataplane``).
Any other run keeps the torch world and its data plane exactly as above: the transport is chosen
once per run, the same on every rank, from the placement.

Collective timeouts: the global group and the weight-sync group time out after ``timeout_s``
(``cluster.timeout_s``). The role groups, mesh axes and subgroups start with torch's defaults (30
minutes on gloo, 10 on NCCL): engines built at start-up run collectives in them while a peer is
still building a slower engine, which only ``cluster.startup_timeout_s`` bounds. Once this rank's
engines are built, ``World.tighten_timeouts`` gives every group it is in ``timeout_s`` too, so a
collective whose peer hangs fails on this side as well, within the time the controller's wait for
the phase gives it. Groups an inference engine makes for itself (vLLM's, SGLang's tensor-parallel
worlds) are the engine's; the controller's wait ends a hang there.
"""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.engines.registry import EngineKind
from rlbatch.placement import Placement, ProcessKind, ProcessSlot, RolePlacement, subgroups
from rlbatch.runtime.control import timed_barrier, timed_bcast
from rlbatch.runtime.env import SchedulerEnv
from rlbatch.runtime.rendezvous import choose_port

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")
SYNC = "sync"
"""Name of the weight-sync group in ``World.groups``: actor_train's first rank + actor_infer's ranks."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the role, the ranks and the operation.
    ``peers``: the world ranks of the group, one of which (not this one) is likely the cause."""

    def __init__(self, message: str, peers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.peers = peers


COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms|Watchdog caught collective operation timeout|"
                                r"wait timeout after \d+ms")
"""How gloo and NCCL word a collective that outlived its group's timeout."""


def as_collective_timeout(e: BaseException, what: str, rank: int, peers: tuple[int, ...],
                          timeout_s: float) -> CollectiveError | None:
    """``e`` as a CollectiveError naming ``peers`` when it is a collective's timeout inside an
    engine (FSDP's, DeepSpeed's, Megatron's own calls), else None: the post-mortem then names the
    peer that hung, not the rank that gave up waiting for it."""
    if isinstance(e, CollectiveError) or not COLLECTIVE_TIMEOUT.search(str(e)):
        return None
    return CollectiveError(f"{what}: a collective timed out on rank {rank} after at most {timeout_s:.0f}s "
                           f"waiting for ranks {list(peers)}: {e}", peers=peers)


@dataclass
class World:
    placement: Placement
    slot: ProcessSlot
    comm: MPI.Comm
    """MPI communicator of all processes; rank == world rank."""
    role_comms: dict[str, MPI.Comm]
    """MPI communicator of each role this process belongs to."""
    groups: dict[str, ProcessGroup]
    """torch ProcessGroup of every role (and SYNC); only meaningful on members."""
    meshes: dict[str, DeviceMesh]
    """DeviceMesh of every GPU role this process belongs to (hybrid MoE adds '<role>.ffn')."""
    device: torch.device
    timeout_s: float
    """``cluster.timeout_s``: the global and the weight-sync groups' collective timeout."""
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """World ranks of every role (and SYNC)."""
    subgroups: dict[str, dict[str, ProcessGroup]] = field(default_factory=dict)
    """This process's groups beyond the mesh axes, per role (``rlbatch.placement.subgroups``)."""
    data_comm: MPI.Comm | None = None
    """The data plane's transport: None, torch.distributed (``rlbatch.runtime.dataplane``); an MPI
    communicator (``comm``), in a run with no torch world (``needs_torch_world``)."""

    @property
    def rank(self) -> int:
        return self.slot.world_rank

    @property
    def size(self) -> int:
        return self.placement.world_size

    @property
    def is_controller(self) -> bool:
        return self.slot.kind is ProcessKind.CONTROLLER

    @property
    def roles(self) -> dict[str, int]:
        """Role -> worker index, for every role this process serves."""
        return dict(self.slot.roles)

    def role_ranks(self, role: str) -> tuple[int, ...]:
        return self.members[role]

    def own_groups(self) -> list[ProcessGroup]:
        """Every process group this process is in: its roles', their mesh axes', their subgroups' and
        the sync group, each once."""
        found: dict[int, ProcessGroup] = {}
        mine = set(self.roles) | ({SYNC} if self.rank in self.members.get(SYNC, ()) else set())
        candidates = [g for name, g in self.groups.items() if name in mine]
        for mesh in self.meshes.values():
            candidates += [mesh.get_group(d) for d in range(mesh.ndim)]
        for extra in self.subgroups.values():
            candidates += list(extra.values())
        for g in candidates:
            if g is not None and dist.get_rank(g) >= 0:
                found.setdefault(id(g), g)
        return list(found.values())

    def tighten_timeouts(self) -> int:
        """Give every group of this process ``timeout_s`` (module doc): called once its engines are
        built. Returns the number of groups set."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        groups = self.own_groups()
        for g in groups:
            _set_pg_timeout(datetime.timedelta(seconds=self.timeout_s), g)
        return len(groups)

    def check(self, op: str, role: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a collective; on failure or timeout raise an error naming role, ranks and op."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses on timeout
            ranks = self.members.get(role, ())
            limit = f" after at most {self.timeout_s:.0f}s" if role == SYNC else ""  # the groups' timeouts: module doc
            raise CollectiveError(
                f"{op} in group '{role}' (world ranks {list(ranks)}) failed on rank {self.rank}{limit}: {e}",
                peers=tuple(r for r in ranks if r != self.rank),
            ) from e


def role_world_ranks(p: Placement, role: RolePlacement) -> tuple[int, ...]:
    """World ranks of a role: its GPU ranks, or the ranks of its CPU workers."""
    return role.gpu_ranks if role.is_gpu else tuple(w[0] for w in role.workers)


def identify(p: Placement, env: SchedulerEnv, mpi_rank: int) -> ProcessSlot | None:
    """This process's slot: by (node, local id) under srun, by MPI rank under mpiexec."""
    if env.under_slurm:
        assert env.slurm_nodeid is not None and env.slurm_localid is not None
        return p.slot_at(env.slurm_nodeid, env.slurm_localid)
    if mpi_rank >= p.world_size:
        return None
    return p.processes[mpi_rank]


def cuda_index(local_gpu: int, node_gpus: int, visible: int, cuda_visible_devices: str | None) -> int:
    """The CUDA device index of a GPU rank among the ``visible`` devices its process sees.

    Every GPU the job uses on the node visible: the rank's local GPU. One visible, and
    CUDA_VISIBLE_DEVICES set: Slurm bound the task to its own GPU (``--gpus-per-task=1``,
    ``--gpu-bind``), which the process sees as device 0. Anything else would put two ranks on
    one GPU or ask for a device the process cannot see.
    """
    if visible >= node_gpus:
        return local_gpu
    if visible == 1 and cuda_visible_devices is not None:
        return 0
    raise RuntimeError(
        f"this GPU rank (local GPU {local_gpu}) sees {visible} CUDA device(s) with "
        f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}, but the placement uses {node_gpus} GPUs on its node: "
        f"make all {node_gpus} visible to every task, or bind each GPU rank's task to exactly one"
    )


def gpu_device_type(device: str) -> str:
    """The device type GPU ranks run on under ``cluster.device`` ('cuda', 'cpu' or 'auto': CUDA
    when this process sees a GPU), as judged here."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def pick_device(p: Placement, slot: ProcessSlot, device: str, cuda_visible_devices: str | None = None) -> torch.device:
    """This process's device: the CPU for the controller and CPU workers, always (they never
    select a GPU); for a GPU rank its GPU when ``device`` asks for CUDA (``cuda_index``)."""
    if slot.kind is not ProcessKind.GPU:
        return torch.device("cpu")
    use_cuda = gpu_device_type(device) == "cuda"
    if not use_cuda:
        return torch.device("cpu")
    assert slot.local_gpu is not None
    index = cuda_index(slot.local_gpu, p.slurm.gpus_per_node, torch.cuda.device_count(), cuda_visible_devices)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _mesh_tensor(role: RolePlacement) -> tuple[torch.Tensor, tuple[str, ...]]:
    names = tuple(n for n, _ in role.mesh)
    shape = tuple(s for _, s in role.mesh)
    return torch.tensor(role.gpu_ranks, dtype=torch.int64).reshape(shape), names


def _ffn_mesh(role: RolePlacement) -> tuple[torch.Tensor, tuple[str, ...]] | None:
    b = role.backend
    if b is None or b.ffn is None:
        return None
    f = b.ffn
    return torch.tensor(role.gpu_ranks, dtype=torch.int64).reshape(f.p, f.d, f.e, f.t), ("pp", "dp", "ep", "tp")


def needs_torch_world(p: Placement) -> bool:
    """Whether the run needs torch.distributed (module doc): some role's engine does
    (``EngineSpec.needs_torch_world``, the registry's word, never the engine's name), or the
    weights are broadcast from actor_train to actor_infer ranks that do not hold the trainer."""
    from rlbatch.engines.registry import spec_of

    if any(spec_of(role.engine).needs_torch_world for role in p.roles.values() if role.is_gpu):
        return True
    train, infer = p.roles.get("actor_train"), p.roles.get("actor_infer")
    return train is not None and infer is not None and not set(infer.gpu_ranks) <= set(train.gpu_ranks)


def build_world(p: Placement, env: SchedulerEnv, device: str = "auto", timeout_s: float = 600.0,
                port_range: tuple[int, int] = (20000, 40000)) -> World | None:
    """Create every communicator, group and mesh. Collective over all processes (spares included)."""
    world = MPI.COMM_WORLD
    slot = identify(p, env, world.Get_rank())
    comm = world.Split(color=0 if slot else MPI.UNDEFINED, key=slot.world_rank if slot else 0)
    if slot is None:
        return None
    if comm.Get_size() != p.world_size:
        raise RuntimeError(
            f"the job has {comm.Get_size()} processes with a slot, but the placement needs {p.world_size}; "
            f"was it started with the sbatch request the dry run printed?"
        )
    role_comms: dict[str, MPI.Comm] = {}
    members: dict[str, tuple[int, ...]] = {}
    for name, role in p.roles.items():  # same order on every rank
        members[name] = role_world_ranks(p, role)
        c = comm.Split(color=0 if slot.world_rank in members[name] else MPI.UNDEFINED, key=slot.world_rank)
        if c != MPI.COMM_NULL:
            role_comms[name] = c

    dev = pick_device(p, slot, device, env.cuda_visible_devices)
    if not needs_torch_world(p):  # the same answer on every rank: the placement decides
        log.info("rank %d: no torch.distributed world (no role needs one); samples move over MPI", slot.world_rank)
        return World(p, slot, comm, role_comms, {}, {}, dev, timeout_s, members, data_comm=comm)
    any_cuda = comm.allreduce(1 if dev.type == "cuda" else 0, op=MPI.SUM) > 0
    backend = "cpu:gloo,cuda:nccl" if any_cuda else "gloo"
    addr: str | None = None
    port: int | None = None
    if slot.world_rank == 0:
        addr = env.master_addr or env.first_node or "127.0.0.1"
        port = choose_port(env.job_id, port_range)
    addr, port = timed_bcast(comm, (addr, port), root=0, timeout_s=timeout_s, what="rendezvous address")
    log.info("rank %d: init_process_group(%s) at %s:%d, world %d", slot.world_rank, backend, addr, port, p.world_size)
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{addr}:{port}", rank=slot.world_rank,
        world_size=p.world_size, timeout=datetime.timedelta(seconds=timeout_s),
    )
    groups: dict[str, ProcessGroup] = {}
    meshes: dict[str, DeviceMesh] = {}
    more: dict[str, dict[str, ProcessGroup]] = {}
    # Each process builds its meshes on its own device type: a DeviceMesh on "cuda" in a process
    # that never selected a GPU (the controller, CPU workers) picks one itself from the world
    # size, and refuses when that is not a multiple of the node's GPUs (8 GPU ranks + reward
    # worker + controller). The device type changes no collective: every rank still creates the
    # same groups in the same order.
    mesh_device = dev.type
    mine = slot_roles(slot)
    for name, role in p.roles.items():
        groups[name] = dist.new_group(list(members[name]))
        if not role.is_gpu:
            continue
        t, names = _mesh_tensor(role)
        mesh = DeviceMesh(mesh_device, t, mesh_dim_names=names)
        if name in mine:
            meshes[name] = mesh
        ep = role.backend.e if role.backend is not None and role.backend.ffn is None else 1
        ffn_dims = role.backend.ffn if role.backend is not None else None
        extra = subgroups.create(role.gpu_ranks, role.mesh, slot.world_rank, dist.new_group, ep, ffn_dims)
        if name in mine and extra:
            more[name] = extra
        if (ffn := _ffn_mesh(role)) is not None:
            fmesh = DeviceMesh(mesh_device, ffn[0], mesh_dim_names=ffn[1])
            if name in mine:
                meshes[f"{name}.ffn"] = fmesh
    train, infer = p.roles.get("actor_train"), p.roles.get("actor_infer")
    if train is not None and infer is not None and infer.backend and infer.backend.kind is EngineKind.INFER:
        # The first actor_train rank broadcasts full weights to every actor_infer rank. The group
        # has timeout_s of its own (``new_group`` would give it torch's default, 30 minutes on gloo,
        # 10 on NCCL): a broadcast whose peer never arrives fails on this side too, naming the group.
        members[SYNC] = tuple(sorted({train.gpu_ranks[0], *infer.gpu_ranks}))
        groups[SYNC] = dist.new_group(list(members[SYNC]), timeout=datetime.timedelta(seconds=timeout_s))
    return World(p, slot, comm, role_comms, groups, meshes, dev, timeout_s, members, more)


def slot_roles(slot: ProcessSlot) -> set[str]:
    return {name for name, _ in slot.roles}


def shutdown(world: World) -> None:
    teardown(world.comm, world.timeout_s)


def teardown(comm: MPI.Comm, timeout_s: float = 60.0) -> None:
    """Destroy torch.distributed on every rank together: all ranks stop using their groups first,
    and none exits (closing its sockets) while another is still tearing down; a gloo thread
    that loses its peer mid-teardown aborts its process ("terminate called without an active
    exception")."""
    if not dist.is_initialized():
        return
    timed_barrier(comm, timeout_s, "teardown: not every rank finished its work")
    dist.destroy_process_group()
    timed_barrier(comm, timeout_s, "teardown: not every rank destroyed its process groups")

