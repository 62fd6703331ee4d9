"""Under mpiexec -n 2: FSDP2 shards, their gradients and AdamW state survive offload/reload bit
for bit, and training goes on afterwards exactly as without the round trip."""

import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from rlbatch.engines.offload import TensorStash, grad_tensors, optimizer_tensors

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
mesh = DeviceMesh("cpu", torch.arange(comm.size), mesh_dim_names=("dp",))


def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def step(m, opt, k):
    opt.zero_grad(set_to_none=False)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * k + comm.rank))
    m(x).pow(2).mean().backward()
    opt.step()


def state(m, opt):
    return [t.to_local().clone() if hasattr(t, "to_local") else t.clone()
            for t in [*m.parameters(), *grad_tensors(m), *optimizer_tensors(opt)]]


a, opt_a = build()
b, opt_b = build()
stashes = [TensorStash("p", a.parameters), TensorStash("g", lambda: grad_tensors(a)), TensorStash("o", lambda: optimizer_tensors(opt_a))]
for k in range(4):
    step(a, opt_a, k)
    step(b, opt_b, k)
    before = state(a, opt_a)
    for s in stashes:
        s.offload()
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in a.parameters()), "device storage not freed"
    for s in stashes:
        s.reload()
    assert all(torch.equal(x, y) for x, y in zip(before, state(a, opt_a), strict=True)), "reload not bit exact"
assert all(torch.equal(x, y) for x, y in zip(state(a, opt_a), state(b, opt_b), strict=True)), "training diverged"
print(f"rank {comm.rank}: offload ok", flush=True)
end_script(comm)
