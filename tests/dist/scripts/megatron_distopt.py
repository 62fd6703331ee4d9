"""Under mpiexec -n 2, the megatron engine at d=2 with megatron-core's distributed optimizer
(``engine_args.distributed_optimizer``; real megatron-core DDP + DistributedOptimizer, CPU, gloo,
the test-only shim):

- AdamW's state on each rank is about half of what the plain optimizer keeps (1/d of every bucket);
- at TP=2 it trains like the plain optimizer too (the gradient norm over TP shards and replicas);
- training (each dp rank its own samples) equals the plain optimizer's (torch AdamW on every rank,
  gradients all-reduced) within float tolerance: losses, gradient norms and weights;
- exact resume with it on: 3 steps, checkpoint through the DCP store, 3 more == 6 steps, bitwise;
- its checkpoint (full tensors) loads into the plain optimizer's engine: same weights and moments;
- offload and reload of params, grads and optimizer state give the same state back, bitwise;
- bf16 parameters (``model.dtype=bf16``, what 'auto' picks on a GPU), with either optimizer, train
  from fp32 main weights: they start at the fp32 model's exact values, three updates at lr 1e-6 move
  them as the fp32 engine's weights move (AdamW applied to the bf16 weights would leave nearly all of
  them where they were: a 1e-6 update is under half a bf16 step of any weight above 2.6e-4), the
  model holds them rounded to bf16, the checkpoint holds them in fp32, offload moves 18 bytes per
  parameter (bf16 weights, fp32 gradients, main weights and moments) and back, and resume is exact.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import checkpoint, restore, same, weights
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

import tests.plugins.megatron_cpu  # noqa: F401  (test-only CPU shim, installs itself)
from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.megatron import MegatronArgs
from rlbatch.engines.megatron.engine import MegatronEngine
from rlbatch.engines.model import load_tokenizer

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
mesh = DeviceMesh("cpu", torch.arange(2).reshape(1, 2, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
mesh_tp2 = DeviceMesh("cpu", torch.arange(2).reshape(1, 1, 1, 2), mesh_dim_names=("pp", "dp", "cp", "tp"))
cfg = compose(["algo.lr=1e-3", "algo.warmup_steps=2", "algo.grad_clip=0.5", "algo.kl_coef=0"])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)
TMP = Path(comm.bcast(tempfile.mkdtemp(prefix="mcore-do-") if comm.rank == 0 else None, root=0))
TOL = 1e-5
"""Relative, for losses and gradient norms: fp32 sums in other orders (a reduce-scatter of each
bucket instead of an all-reduce, the norm summed per slice), ~1e-7 apart."""
WTOL = 1e-4
"""Weights after 6 updates of lr 1e-3: AdamW divides by the gradient's own scale, so an element whose
gradient is rounding noise may move up to lr per update differently (measured 4.3e-6); a slice
stepped twice, or not at all, is off by ~lr = 1e-3 or more."""


def megatron(distributed, on=mesh):
    return MegatronEngine(EngineContext("actor_train", MegatronArgs(distributed_optimizer=distributed), cfg.model,
                                        cfg.algo, tok, torch.device("cpu"), seed=3, mesh=on, trainable=True))


def batch(step, own=True):
    """Each dp rank its own samples (``own``), or the same on both (tp peers)."""
    g = torch.Generator().manual_seed(100 + 10 * step + (comm.rank if own else 0))
    return [{"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
             "response": torch.randint(4, 18, (1 + k % 5,), generator=g),
             "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(6)]


def train(e, steps, own=True):
    out = []
    for s in steps:
        samples = batch(s, own)
        for x, old in zip(samples, e.logprobs(samples), strict=True):
            x["old_logprobs"] = old
        out.append(e.train(samples, objective))
    return out


def state_numel(e):
    return sum(v.numel() for s in e.optimizer.state.values() for k, v in s.items() if k != "step")


plain, sharded = megatron(False), megatron(True)
a, b = train(plain, range(6)), train(sharded, range(6))
for step, (x, y) in enumerate(zip(a, b, strict=True)):
    for key in ("pg_loss", "grad_norm", "lr"):
        assert abs(x[key] - y[key]) <= TOL * max(1.0, abs(x[key])), f"step {step} {key}: plain {x[key]} sharded {y[key]}"
wp, ws = weights(plain), weights(sharded)
gap = max(float((wp[n] - ws[n]).abs().max()) for n in wp)
moved = max(float((wp[n] - w0).abs().max()) for n, w0 in weights(megatron(False)).items())
assert gap < WTOL and moved > 10 * WTOL, f"after 6 updates: plain vs sharded {gap}, moved {moved}"
ratio = state_numel(sharded) / state_numel(plain)
assert 0.45 < ratio <= 0.55, f"AdamW state on rank {comm.rank}: {state_numel(sharded)} of {state_numel(plain)}"
print(f"rank {comm.rank}: distributed optimizer within {gap:.1e} of the plain one after 6 updates "
      f"(weights moved {moved:.1e}); AdamW state {state_numel(sharded)} / {state_numel(plain)} = {ratio:.3f}", flush=True)

# TP=2 (one dp replica): the norm counts TP-split weights on both ranks and replicated ones once.
a, b = train(megatron(False, mesh_tp2), range(3), own=False), train(megatron(True, mesh_tp2), range(3), own=False)
for step, (x, y) in enumerate(zip(a, b, strict=True)):
    for key in ("pg_loss", "grad_norm"):
        assert abs(x[key] - y[key]) <= TOL * max(1.0, abs(x[key])), f"TP=2 step {step} {key}: {x[key]} vs {y[key]}"

before = sharded.checkpoint_state().tensors
moved_out = sharded.offload(["params", "grads", "optimizer"])
assert moved_out.bytes > 0 and sharded.reload(["params", "grads", "optimizer"]).bytes == moved_out.bytes
same(sharded.checkpoint_state().tensors, before, "distributed optimizer: offload and reload")

half = megatron(True)
train(half, range(3))
checkpoint(half, TMP / "do3")
resumed = megatron(True)
restore(resumed, TMP / "do3")
train(resumed, range(3, 6))
same(weights(resumed), ws, "distributed optimizer: resume 3+3 vs 6")
ckpt = resumed.checkpoint_state().tensors
same({k: v for k, v in ckpt.items() if k.startswith("optim.")},
     {k: v for k, v in sharded.checkpoint_state().tensors.items() if k.startswith("optim.")}, "resumed Adam state")

into_plain = megatron(False)
restore(into_plain, TMP / "do3")
theirs = into_plain.checkpoint_state().tensors
mine = half.checkpoint_state().tensors
same(mine, theirs, "distributed optimizer checkpoint into the plain optimizer")

# bf16 parameters: fp32 main weights by default, with torch AdamW and with the distributed optimizer.
RL_LR = 1e-6
rl = {dtype: compose(["algo.lr=1e-6", "algo.warmup_steps=0", "algo.grad_clip=0.5", "algo.kl_coef=0",
                      f"model.dtype={dtype}"]) for dtype in ("fp32", "bf16")}
DRIFT = 0.1
"""Mean |bf16 engine's update - fp32 engine's| over their mean update: the bf16 forward perturbs each
gradient by ~2^-8 relative and AdamW's update (about lr, its sign the gradient's) follows, except where
a gradient near 0 flips sign (measured 0.019). AdamW on the bf16 weights themselves gives ~1.0."""


def rl_engine(dtype, distributed=False):
    c = rl[dtype]
    return MegatronEngine(EngineContext("actor_train", MegatronArgs(distributed_optimizer=distributed), c.model, c.algo,
                                        tok, torch.device("cpu"), seed=3, mesh=mesh, trainable=True))


def main_weights(e):
    return {k[len("model."):]: v for k, v in e.checkpoint_state().tensors.items() if k.startswith("model.")}


reference = rl_engine("fp32")
w0 = main_weights(reference)
train(reference, range(3))
w3 = main_weights(reference)
step32 = torch.cat([(w3[n] - w0[n]).flatten() for n in w0])
assert float(step32.abs().mean()) > 3 * RL_LR / 2, f"fp32 engine moved {float(step32.abs().mean())}"
for distributed in (False, True):
    low = rl_engine("bf16", distributed)
    assert {p.dtype for p in low.model.parameters()} == {torch.bfloat16}
    m0 = main_weights(low)
    same(m0, w0, f"bf16 (distributed optimizer {distributed}): initial main weights")
    train(low, range(3))
    main = main_weights(low)
    assert {t.dtype for t in low.checkpoint_state().tensors.values()} == {torch.float32}
    exported = weights(low)
    same(exported, {n: main[n].bfloat16() for n in exported},
         f"bf16 (distributed optimizer {distributed}): the model's weights, the main weights rounded")
    step16 = torch.cat([(main[n] - m0[n]).flatten() for n in w0])
    drift = float((step16 - step32).abs().mean() / step32.abs().mean())
    assert drift < DRIFT, f"bf16 (distributed optimizer {distributed}): updates {drift:.3f} of the fp32 engine's apart"
    print(f"rank {comm.rank}: bf16 parameters, distributed optimizer {distributed}: 3 updates at lr {RL_LR} moved the "
          f"main weights {float(step16.abs().mean()):.3e} on average (fp32 engine {float(step32.abs().mean()):.3e}), "
          f"{drift:.3f} of that apart", flush=True)
    if not distributed:
        whole = low
before16 = whole.checkpoint_state().tensors
moved16 = whole.offload(["params", "grads", "optimizer"])
n16 = sum(p.numel() for p in whole.model.parameters())
# bf16 weights (2 bytes), fp32 gradients (4), fp32 main weights and AdamW's two moments (12).
assert moved16.bytes == 18 * n16, f"bf16 offload moved {moved16.bytes} bytes for {n16} parameters"
assert whole.reload(["params", "grads", "optimizer"]).bytes == moved16.bytes
same(whole.checkpoint_state().tensors, before16, "bf16: offload and reload")
two = rl_engine("bf16")
train(two, range(2))
checkpoint(two, TMP / "bf16-2")
resumed16 = rl_engine("bf16")
restore(resumed16, TMP / "bf16-2")
train(resumed16, range(2, 3))
same(resumed16.checkpoint_state().tensors, whole.checkpoint_state().tensors, "bf16: resume 2+1 vs 3, main weights and moments")
same(weights(resumed16), weights(whole), "bf16: resume 2+1 vs 3, bf16 weights")

dist.barrier()
if comm.rank == 0:
    shutil.rmtree(TMP, ignore_errors=True)
print(f"rank {comm.rank}: megatron distributed optimizer ok", flush=True)
end_script(comm)
