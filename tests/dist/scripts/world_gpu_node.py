"""Under mpiexec -n 10: the world of one 8-GPU node (8 GPU ranks, a CPU reward worker, the
controller) builds, each process's meshes on its own device type, and only the GPU ranks select
a GPU, each its own.

This machine has no GPU, so torch.cuda is a stand-in with what DeviceMesh reads of it: 8 devices,
and ``is_initialized()`` true only once this process called ``set_device``. The process group
is gloo in place of "cpu:gloo,cuda:nccl" (this build has no NCCL); the meshes' collectives below
move CPU tensors, as gloo does under the mixed backend too.
"""

import os
import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

from rlbatch.placement import ProcessKind, place
from rlbatch.runtime.env import read_env
from rlbatch.runtime.world import build_world, shutdown

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
os.environ.pop("LOCAL_RANK", None)  # DeviceMesh would take the device from it instead of guessing

selected: list[int] = []
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 8
torch.cuda.is_initialized = lambda: bool(selected)
torch.cuda.set_device = selected.append
_init = dist.init_process_group
dist.init_process_group = lambda backend=None, **kw: _init("gloo", **kw)

placement = place({"cluster": {"gpus_per_node": 8}, "roles": {
    "actor_train": {"device_mapping": list(range(8)), "backend": "fsdp:d4t2"},
    "actor_infer": {"device_mapping": list(range(8)), "backend": "vllm:d8"},
    "reward": {"world_size": 1},
}})
assert placement.world_size == comm.size == 10, (placement.world_size, comm.size)
env = read_env({"RLBATCH_JOB_ID": "world-gpu-node"})
world = build_world(placement, env, device="auto", timeout_s=120.0, port_range=(port, port + 64))
assert world is not None
slot = world.slot
if slot.kind is ProcessKind.GPU:
    assert selected == [slot.local_gpu] and world.device == torch.device("cuda", slot.local_gpu), (world.rank, selected)
    assert set(world.meshes) == {"actor_train", "actor_infer"}, world.meshes
    assert all(m.device_type == "cuda" for m in world.meshes.values())
    # The meshes line up across ranks: dp peers are the ranks with the same tp coordinate.
    dp = world.meshes["actor_train"].get_group("dp")
    total = torch.tensor([float(world.rank)])
    dist.all_reduce(total, group=dp)
    assert total.item() == sum(r for r in range(8) if r % 2 == world.rank % 2), (world.rank, total)
else:
    assert selected == [] and world.device == torch.device("cpu") and world.meshes == {}, (world.rank, selected)
everyone = torch.tensor([1.0])
dist.all_reduce(everyone)  # the whole world, controller and reward worker included
assert everyone.item() == 10.0, everyone
print(f"rank {world.rank}: world ok on {world.device}", flush=True)
# Not mpi_exit.end_script: with MPICH's hydra, os._exit straight after MPI_Finalize has ranks of a
# 10-process job reported as killed (signal 9) in most runs. Here the process groups are destroyed
# on every rank together, and mpi4py finalizes MPI at the normal exit.
shutdown(world)
