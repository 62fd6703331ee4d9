"""Under mpiexec -n 2: the fsdp engine with each distinct prompt run once (``share_prompts``, the
default) computes the same log-probs and trains to the same weights as with every sample's
prompt run in full, for a model that is one FSDP unit and for one with a unit per layer (each
unit then runs twice per forward: the prompts, then the responses on their cache)."""

import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.engines.batch import Shared, pack
from rlbatch.engines.model import load_tokenizer
from rlbatch.engines.train.fsdp import FSDPEngine
from rlbatch.launch.compose import compose

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
mesh = DeviceMesh("cpu", torch.arange(comm.size), mesh_dim_names=("dp",))
cfg = compose(["algo.mini_batches=2", "algo.lr=1e-2", "algo.entropy_coef=0.01"])
tok = load_tokenizer(cfg.model)


def engine(**engine_args: object) -> FSDPEngine:
    return FSDPEngine(model_cfg=cfg.model, tokenizer=tok, device=torch.device("cpu"), seed=3, mesh=mesh,
                      algo=cfg.algo, trainable=True, engine_args=dict(engine_args))


g = torch.Generator().manual_seed(comm.rank)
prompts = [torch.randint(4, 18, (2 + k % 4,), generator=g) for k in range(4)]  # 4 prompts of 2-5 tokens
samples = [{"prompt": prompts[k % 4], "response": torch.randint(4, 18, (1 + k % 3,), generator=g),
            "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(32)]
assert isinstance(pack(samples[:16], tok.pad_token_id, torch.device("cpu"), share_prompts=True).inputs, Shared)
for units in ({}, {"single_unit_max_mb": 0}):
    shared, full = engine(**units), engine(share_prompts=False, **units)
    assert shared.share_prompts and not full.share_prompts
    for s, a, b in zip(samples, shared.logprobs(samples), full.logprobs(samples), strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a, b)
        s["ref_logprobs"] = a - 0.05
        s["old_logprobs"] = a
    for _ in range(3):
        stats_shared, stats_full = shared.train(samples), full.train(samples)
        for s, old in zip(samples, full.logprobs(samples), strict=True):
            s["old_logprobs"] = old
    assert abs(stats_shared["pg_loss"] - stats_full["pg_loss"]) < 1e-5, (stats_shared, stats_full)
    for a, b in zip(shared.logprobs(samples), full.logprobs(samples), strict=True):
        assert torch.allclose(a, b, atol=1e-5), (units, a, b)
    with shared.full_weights() as ws, full.full_weights() as wf, engine(**units).full_weights() as w0:
        for (name, a), (_, b), (_, c) in zip(ws, wf, w0, strict=True):
            assert not torch.equal(a, c), f"{name} did not train"
            # Adam turns the rounding noise of a zero-gradient parameter (k_proj's bias: softmax
            # ignores a per-query constant) into steps of ~1e-5; the log-probs above are the check.
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), f"{name} ({units}): max diff {(a - b).abs().max():.3g}"
print(f"rank {comm.rank}: shared prompts ok", flush=True)
end_script(comm)
