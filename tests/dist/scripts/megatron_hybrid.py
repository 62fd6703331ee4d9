"""Under mpiexec -n 4, the megatron engine under hybrid layouts ``megatron:(attn:<dims>|ffn:<dims>)``
(MoE parallel folding: attention over one layout of the four ranks, the routed experts over
another) on real megatron-core (CPU, gloo, the test-only shim), a random-init Qwen2-MoE (4 routed
experts, top-2, a gated shared expert), against the same model at ``megatron:d2t2`` (attention and
experts both split over tp):

- ``(attn:d2t2|ffn:t2e2)``: each expert split over 2 expert-tensor ranks, the experts over 2
  expert-parallel ranks that are different attention replicas; ``(attn:d2t2|ffn:e4)``: attention's
  tensor-parallel pairs folded into expert parallelism, one whole expert per rank;
- HF -> GPTModel -> HF is exact (export gives the HF weights bit for bit) and log-probs equal
  transformers' within float tolerance;
- three updates (two mini-batches of two gradient-accumulation micro-batches each), each replica
  its own samples, ragged (the expert-tensor ranks receive unequal token counts): d2t2's losses and
  gradient norms, and weights within float tolerance after. The arithmetic is the same; only the
  order of the sums differs (tokens reach an expert in another order, its shards are reduced over
  other groups), so float32 rounding is what separates them.
"""

import sys
import time

import torch
import torch.distributed as dist
from engine_state import policy_steps, same, weights
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

import tests.plugins.megatron_cpu  # noqa: F401  (test-only CPU shim, installs itself)
from rlbatch import algos
from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.batch import pack, response_logits, unpack
from rlbatch.engines.megatron import MegatronArgs
from rlbatch.engines.megatron.engine import MegatronEngine
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.placement import subgroups
from rlbatch.placement.backend import parse_backend

T0 = time.time()
comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
assert comm.size == 4
cfg = compose(["model.arch=qwen2_moe", "algo=ppo", "algo.lr=1e-2", "algo.warmup_steps=2", "algo.grad_clip=0.5",
               "algo.mini_batches=2", "algo.grad_accum=2"])
tok = load_tokenizer(cfg.model)
policy = PolicyObjective(cfg.algo)
SEED = 3
TOL = 1e-4
"""fp32 with |logp| ~ 3 and grad norms ~ 10: layouts differ by ~1e-6 relative; an expert shard in the
wrong place or a gradient summed over the wrong group is off by ~0.01 or more."""
WEIGHT_TOL = 1e-3


def engine(spec):
    """The engine under ``spec`` over all four ranks, with the groups ``rlbatch.runtime.world`` makes."""
    b = parse_backend(spec)
    a = b.dims
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(a.p, a.d, a.c, a.t), mesh_dim_names=("pp", "dp", "cp", "tp"))
    shape = (("pp", a.p), ("dp", a.d), ("cp", a.c), ("tp", a.t))
    groups = {"role": dist.new_group(list(range(4))),
              **subgroups.create(list(range(4)), shape, comm.rank, dist.new_group, 1 if b.ffn else a.e, b.ffn)}
    return MegatronEngine(EngineContext("actor_train", MegatronArgs(micro_batch=3), cfg.model, cfg.algo, tok,
                                        torch.device("cpu"), seed=SEED, mesh=mesh, trainable=True, groups=groups))


REPLICA = comm.rank // 2
"""Every layout here has attention d2t2: ranks 0-1 are one replica, 2-3 the other."""


def batch(step):
    """This replica's samples (its tp pair receives the same); the two replicas' lengths differ."""
    g = torch.Generator().manual_seed(100 + step + 1000 * REPLICA)
    return [{"prompt": torch.randint(4, 18, (3 + (k + REPLICA) % 4,), generator=g),
             "response": torch.randint(4, 18, (1 + (k + 2 * REPLICA) % 5,), generator=g),
             "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(8)]


hf = load_model(cfg.model, tok, SEED)
hf_weights = {n: p.detach().clone() for n, p in hf.named_parameters()}
own = batch(0)
b = pack(own, tok.pad_token_id, torch.device("cpu"))
with torch.no_grad():
    ref = unpack(algos.token_logprobs(response_logits(hf, b).float(), b.targets), b.lengths)
LOCAL = {"megatron:d2t2": (4, 2), "megatron:(attn:d2t2|ffn:t2e2)": (2, 2), "megatron:(attn:d2t2|ffn:e4)": (1, 1)}
"""Layout -> (routed experts on each rank, expert-tensor ranks each is split over)."""

runs = {}
print(f"rank {comm.rank}: started in {time.time() - T0:.1f} s", flush=True)
for spec, (experts, etp) in LOCAL.items():
    t0 = time.time()
    e = engine(spec)
    assert (e.lay.local_experts, e.etp) == (experts, etp), (spec, e.lay.local_experts, e.etp)
    fc1 = e.params["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert fc1.shape[0] == 2 * hf.config.moe_intermediate_size // etp, (spec, fc1.shape)
    same(weights(e), hf_weights, f"HF -> GPTModel -> HF at {spec}")
    err = max(float((x - y).abs().max()) for x, y in zip(e.logprobs(own), ref, strict=True))
    assert err < TOL, f"{spec} log-probs differ from transformers' by {err}"
    runs[spec] = (policy_steps(e, range(3), batch, policy), weights(e))
    print(f"rank {comm.rank}: {spec} exports exactly, log-probs within {err:.1e} of transformers' ({time.time() - t0:.1f} s)",
          flush=True)
    del e

want_stats, want = runs["megatron:d2t2"]
moved = max(float((want[n] - hf_weights[n]).abs().max()) for n in want)
for spec in list(LOCAL)[1:]:
    stats, got = runs[spec]
    for step, (x, y) in enumerate(zip(stats, want_stats, strict=True)):
        for key in ("pg_loss", "grad_norm"):
            assert abs(x[key] - y[key]) < TOL * max(1.0, abs(y[key])), f"step {step} {key}: {spec} {x[key]} d2t2 {y[key]}"
        print(f"rank {comm.rank}: step {step} {spec} pg_loss {x['pg_loss']:.7f} d2t2 {y['pg_loss']:.7f} grad_norm "
              f"{x['grad_norm']:.6f} {y['grad_norm']:.6f}", flush=True)
    err = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert err < WEIGHT_TOL < moved / 10, f"after 3 updates {spec} and d2t2 weights differ by {err} (moved {moved})"
    print(f"rank {comm.rank}: after 3 updates {spec} weights within {err:.1e} of d2t2's (moved {moved:.1e})", flush=True)

print(f"rank {comm.rank}: megatron hybrid ok", flush=True)
end_script(comm)
