"""Under mpiexec -n 3: samples with token and float fields move rank to rank exactly, also when
later exchanges reuse receive buffers."""

import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script

from rlbatch.runtime.dataplane import Move, SampleStore, exchange

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)


def sample(i):
    g = torch.Generator().manual_seed(i)
    p, r = 3 + i % 4, 1 + i % 5
    return {"prompt": torch.randint(0, 50000, (p,), generator=g), "response": torch.randint(0, 50000, (r,), generator=g),
            "ref_logprobs": -torch.rand(r, generator=g)}


store = SampleStore()
owned = {0: [0, 1, 2, 3], 1: [4, 5], 2: []}
for i in owned[comm.rank]:
    for f, t in sample(i).items():
        store.put(i, f, t)
fields = ["prompt", "response", "ref_logprobs"]
lens = lambda ids: [[len(sample(i)[f]) for f in fields] for i in ids]  # noqa: E731
moves = [Move(0, 2, [0, 2], fields, lens([0, 2])), Move(1, 2, [5], fields, lens([5])),
         Move(0, 1, [3], ["response"], [[len(sample(3)["response"])]]), Move(1, 0, [4], fields, lens([4]))]
stats = exchange(store, comm.rank, moves)


def check(expect):
    assert sorted(store.samples) == expect, (comm.rank, sorted(store.samples))
    for i in expect:
        for f, t in store.samples[i].items():
            ref = sample(i)[f]
            assert t.dtype == ref.dtype and torch.equal(t, ref), (comm.rank, i, f)


check({0: [0, 1, 2, 3, 4], 1: [3, 4, 5], 2: [0, 2, 5]}[comm.rank])
assert comm.rank != 2 or stats["bytes_received"] > 0
# More from the same peers while the first samples are kept: their receive buffers (large enough
# for sample 1) are not reused.
exchange(store, comm.rank, [Move(0, 2, [1], fields, lens([1])), Move(1, 2, [4], fields, lens([4]))])
check({0: [0, 1, 2, 3, 4], 1: [3, 4, 5], 2: [0, 1, 2, 4, 5]}[comm.rank])
# Once they are dropped, the buffers are free to take the next samples.
if comm.rank == 2:
    store.drop([0, 1, 2, 4, 5])
exchange(store, comm.rank, [Move(0, 2, [0, 2], fields, lens([0, 2])), Move(1, 2, [5], fields, lens([5]))])
check({0: [0, 1, 2, 3, 4], 1: [3, 4, 5], 2: [0, 2, 5]}[comm.rank])
print(f"rank {comm.rank}: dataplane ok", flush=True)
end_script(comm)
