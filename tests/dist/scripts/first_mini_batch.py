"""Under mpiexec -n 2: training with old log-probs left out for the first mini-batch (trained
before any update, so old = current) gives the same weights as with every old log-prob computed;
leaving them out of a later mini-batch is refused."""

import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.model import load_tokenizer

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
mesh = DeviceMesh("cpu", torch.arange(comm.size), mesh_dim_names=("dp",))
cfg = compose(["algo.mini_batches=2", "algo.lr=1e-2"])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)


def engine() -> FSDPEngine:
    return FSDPEngine(EngineContext("actor_train", FSDPArgs(), cfg.model, cfg.algo, tok, torch.device("cpu"),
                                    seed=3, mesh=mesh, trainable=True))


g = torch.Generator().manual_seed(comm.rank)
samples = [{"prompt": torch.randint(4, 18, (4,), generator=g), "response": torch.randint(4, 18, (1 + k % 3,), generator=g),
            "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(16)]
full, part = engine(), engine()
for s, old in zip(samples, full.logprobs(samples), strict=True):
    s["ref_logprobs"] = old - 0.05
    s["old_logprobs"] = old
lean = [dict(s) for s in samples]
for s in lean[:8]:
    del s["old_logprobs"]
for _ in range(3):  # later steps see weights that moved: old and current differ from the first update on
    stats_full, stats_part = full.train(samples, objective), part.train(lean, objective)
    for s, old in zip(samples, full.logprobs(samples), strict=True):
        s["old_logprobs"] = old
    for s, old in zip(lean[8:], part.logprobs(lean[8:]), strict=True):
        s["old_logprobs"] = old
with engine().export_weights() as w:
    initial = {name: t.clone() for name, t in w}
with full.export_weights() as wf, part.export_weights() as wp:
    for (name, a), (_, b) in zip(wf, wp, strict=True):
        assert not torch.equal(a, initial[name]), f"{name} did not train"
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{name}: max diff {(a - b).abs().max():.3g}"
assert abs(stats_full["pg_loss"] - stats_part["pg_loss"]) < 1e-5, (stats_full, stats_part)
broken = [dict(s) for s in samples]
del broken[12]["old_logprobs"]
try:
    engine().train(broken, objective)
except ValueError as e:
    assert "mini-batch 1" in str(e), e
else:
    raise AssertionError("a later mini-batch without old log-probs was accepted")
print(f"rank {comm.rank}: first mini-batch ok", flush=True)
end_script(comm)
