"""Under mpiexec -n 3: weight sync lands the sender's weights bit for bit in every receiver, on
each of two syncs with changed weights (the buckets and buffers of the first are reused).
Rank 0 sends and has no inference engine; rank 1's engine has flattened fp32 parameters
(received in place); rank 2's has separate bf16 parameters, registered in the reverse order
(staged, then loaded by name with a cast: only the sender's names and shapes say what arrives).
Then with bf16 on the wire, as for a bf16 inference engine: half the bytes, and the same bf16
weights as a cast on load gives (flattened: received in place; separate: staged)."""

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script

from rlbatch.engines.base import WeightStream
from rlbatch.engines.flat import flatten_parameters
from rlbatch.engines.hf.engine import HFInferenceEngine
from rlbatch.loop.weightsync import WeightBroadcast
from rlbatch.runtime.world import SYNC

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
SHAPES = [(8, 16), (4,), (40, 40), (3, 5), (16, 16), (7,)]  # 4 KB buckets: (40, 40) travels alone
BUCKET_BYTES = 4096


class Engine:
    load_weights, weight_views = HFInferenceEngine.load_weights, HFInferenceEngine.weight_views

    def __init__(self, dtype: torch.dtype, flat: bool) -> None:
        self.model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s, dtype=dtype), requires_grad=False)
                                            for s in SHAPES)
        if flat:
            flatten_parameters(self.model)
        named = [(f"w{i}", p) for i, p in enumerate(self.model)]
        self._params = dict(named if flat else reversed(named))


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(s, generator=g)) for i, s in enumerate(SHAPES)]


world = SimpleNamespace(rank=comm.rank, device=torch.device("cpu"), groups={SYNC: dist.group.WORLD},
                        members={SYNC: (0, 1, 2)}, check=lambda op, role, fn, *a, **k: fn(*a, **k))


def check_two_syncs(wire: torch.dtype, infer_dtypes: dict[int, torch.dtype], seeds: tuple[int, int]) -> None:
    """Two syncs with ``wire`` on the wire into rank 1 (flattened) and rank 2 (separate) engines:
    every receiver holds the sent weights cast to its dtype, bit for bit; the bytes are the wire's."""
    engine = {0: None, 1: Engine(infer_dtypes[1], flat=True), 2: Engine(infer_dtypes[2], flat=False)}[comm.rank]
    sync = WeightBroadcast(wire)
    for seed in seeds:
        sent = weights(seed)
        nbytes = sync(world, WeightStream.of(sent) if comm.rank == 0 else None, engine, 0, BUCKET_BYTES)  # type: ignore[arg-type]
        assert nbytes == wire.itemsize * sum(t.numel() for _, t in sent), nbytes
        if engine is not None:
            for name, t in sent:
                got = engine._params[name]
                assert torch.equal(got, t.to(got.dtype)), (comm.rank, seed, name)
    if comm.rank == 1:  # received in place: the parameters are still views into one buffer
        assert len({p.untyped_storage().data_ptr() for p in engine._params.values()}) == 1


check_two_syncs(torch.float32, {1: torch.float32, 2: torch.bfloat16}, (1, 2))
check_two_syncs(torch.bfloat16, {1: torch.bfloat16, 2: torch.bfloat16}, (3, 4))
print(f"rank {comm.rank}: weightsync ok", flush=True)
end_script(comm)
