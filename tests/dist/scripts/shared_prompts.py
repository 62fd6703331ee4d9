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

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.batch import Shared, pack
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.model import load_tokenizer

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
mesh = DeviceMesh("cpu", torch.arange(comm.size), mesh_dim_names=("dp",))
cfg = compose(["algo.mini_batches=2", "algo.lr=1e-2", "algo.entropy_coef=0.01"])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)

# How far apart the two passes may honestly be. float32 rounds every operation to u = 2**-24 ~ 6e-8.
# The shared pass runs each prompt left-padded on its own and the responses on its KV cache; the
# full pass runs one right-padded sequence per sample. Same sums, other order: the kernels see
# other shapes and block their reductions differently, and each softmax sums another set of
# (masked) keys. A reordered sum of K terms moves by ~sqrt(K)*u of its magnitude (the rounding
# errors add as a random walk; K*u is the worst case).
#
# FORWARD: one log-prob passes 12 reductions per layer, 2 layers: q, k, v, o, gate, up (K = 64),
# down (256), scores (16 = head dim), softmax and its weighted sum (<= 8 keys: prompts of 2-5
# tokens plus responses of 1-3), two RMSNorms (64); then the final norm and the tied head (64):
# 26 in all, each of at most 256 terms. As a random walk over all of them: sqrt(26 * 256) * u ~
# 4.9e-6 relative. Logits of the random-init model (vocabulary 18; RMSNorm keeps hidden states
# O(1)) are at most ~3.2, and log p = z_y - logsumexp(z) adds the errors of two of them:
# 2 * 3.2 * 4.9e-6 ~ 3e-5. (Measured: at most 1.7e-6 over 21 data/model seeds.)
FORWARD = 3e-5
# TRAINED: after 3 x 2 AdamW updates the weights differ by more than rounding: Adam divides each
# gradient element by its own magnitude, so a gradient rounding difference dg (here <= 5e-7, ~1e-6
# of the largest element of its tensor: a sum over every token in another order) becomes a step
# difference of ~lr * dg / |g|, and a 64x64 matrix has elements whose |g| is itself ~1e-7: their
# steps differ by ~1e-4 in one update (measured 1.1e-4 at lr 1e-2). The log-probs then move by
# the same order (measured: at most 1.8e-4 over 21 seeds, weights 6.3e-5). A broken shared pass
# is O(1) away: with the prompt cache detached from the backward, log-probs differed by 2-6,
# weights by 3.5e-2, pg_loss by 0.1-3.
TRAINED = 2e-3


def engine(**engine_args: object) -> FSDPEngine:
    return FSDPEngine(EngineContext("actor_train", FSDPArgs(**engine_args), cfg.model, cfg.algo, tok,  # type: ignore[arg-type]
                                    torch.device("cpu"), seed=3, mesh=mesh, trainable=True))


g = torch.Generator().manual_seed(comm.rank)
prompts = [torch.randint(4, 18, (2 + k % 4,), generator=g) for k in range(4)]  # 4 prompts of 2-5 tokens
samples = [{"prompt": prompts[k % 4], "response": torch.randint(4, 18, (1 + k % 3,), generator=g),
            "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(32)]
assert isinstance(pack(samples[:16], tok.pad_token_id, torch.device("cpu"), share_prompts=True).inputs, Shared)
for units in ({}, {"single_unit_max_mb": 0}):
    shared, full = engine(**units), engine(share_prompts=False, **units)
    assert shared.share_prompts and not full.share_prompts
    for s, a, b in zip(samples, shared.logprobs(samples), full.logprobs(samples), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=FORWARD), (a, b)
        s["ref_logprobs"] = a - 0.05
        s["old_logprobs"] = a
    for _ in range(3):
        stats_shared, stats_full = shared.train(samples, objective), full.train(samples, objective)
        for s, old in zip(samples, full.logprobs(samples), strict=True):
            s["old_logprobs"] = old
    # pg_loss: a mean of ratio * advantage terms, |advantage| <= 2, ratio - 1 ~ the log-prob difference.
    assert abs(stats_shared["pg_loss"] - stats_full["pg_loss"]) < 2 * TRAINED, (stats_shared, stats_full)
    for a, b in zip(shared.logprobs(samples), full.logprobs(samples), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=TRAINED), (units, a, b)
    with shared.export_weights() as ws, full.export_weights() as wf, engine(**units).export_weights() as w0:
        for (name, a), (_, b), (_, c) in zip(ws, wf, w0, strict=True):
            assert not torch.equal(a, c), f"{name} did not train"
            # Adam's steps of near-zero gradient elements differ (see TRAINED); the log-probs
            # above are the check.
            assert torch.allclose(a, b, rtol=0, atol=TRAINED), f"{name} ({units}): max diff {(a - b).abs().max():.3g}"
print(f"rank {comm.rank}: shared prompts ok", flush=True)
end_script(comm)
