"""Under mpiexec -n 2, the megatron engine on a Mixture-of-Experts model (a random-init Qwen2-MoE:
4 routed experts, top-2, a gated shared expert) on real megatron-core (CPU, gloo, the test-only
shim), data parallel d=2 without expert parallelism and with it (e=2: each rank holds 2 of the 4
experts, tokens travel to them by all-to-all), against transformers and the fsdp engine:

- HF -> GPTModel -> HF is exact (export gives the HF weights bit for bit) at e=1, e=2, p=2 and,
  forward-only (a reference), t=2, and from a saved model directory (model.path) at e=2;
- log-probs equal transformers' within float tolerance at e=1, e=2, p=2 and forward-only t=2;
- four updates at t=2 with sequence parallelism (the norms and the router on half the sequence
  each), with torch AdamW and with the distributed optimizer, give p=2's losses and gradient norms,
  and weights within float tolerance, on the same samples; a trainable t=2 engine without sequence parallelism is refused (megatron-core's rule);
- six updates (two mini-batches of two gradient-accumulation micro-batches each per step), each
  rank its own samples: e=1 and e=2 give the fsdp engine's losses and gradient norms on the
  transformers model, and weights within float tolerance after;
- exact resume at e=2: 3 steps, checkpoint through the DCP store, 3 more == 6 steps, bitwise;
- an fsdp checkpoint loads into e=2 (weights and Adam moments bitwise) and e=2's back into fsdp.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import bf16_like, policy_steps, resumes_exactly, same, shares_checkpoints_with_fsdp, weights
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

import tests.plugins.megatron_cpu  # noqa: F401  (test-only CPU shim, installs itself)
from rlbatch import algos
from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.batch import pack, response_logits, unpack
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.megatron import MegatronArgs
from rlbatch.engines.megatron.engine import MegatronEngine
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.placement import subgroups

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
NAMES = ("pp", "dp", "cp", "tp")
mesh_dp2 = DeviceMesh("cpu", torch.arange(2).reshape(1, 2, 1, 1), mesh_dim_names=NAMES)
mesh_pp2 = DeviceMesh("cpu", torch.arange(2).reshape(2, 1, 1, 1), mesh_dim_names=NAMES)
mesh_tp2 = DeviceMesh("cpu", torch.arange(2).reshape(1, 1, 1, 2), mesh_dim_names=NAMES)
cfg = compose(["model.arch=qwen2_moe", "algo=ppo", "algo.lr=1e-2", "algo.warmup_steps=2", "algo.grad_clip=0.5",
               "algo.mini_batches=2", "algo.grad_accum=2"])
tok = load_tokenizer(cfg.model)
policy = PolicyObjective(cfg.algo)
SEED = 3
TMP = Path(comm.bcast(tempfile.mkdtemp(prefix="mcore-moe-") if comm.rank == 0 else None, root=0))
TOL = 1e-4
"""fp32 with |logp| ~ 3: the engines and transformers differ by ~1e-6; an expert's weights in the
wrong place, a wrong routing rule or a lost shared-expert gate is off by ~0.01 or more."""
WEIGHT_TOL = 1e-3
# The role's groups as rlbatch.runtime.world makes them, with expert parallelism e=2 over dp.
EP2 = {"role": dist.new_group([0, 1]),
       **subgroups.create([0, 1], (("pp", 1), ("dp", 2), ("cp", 1), ("tp", 1)), comm.rank, dist.new_group, ep=2)}


def engine(mesh, groups=None, trainable=True, args=None, model=None):
    return MegatronEngine(EngineContext("actor_train", args or MegatronArgs(micro_batch=3), model or cfg.model,
                                        cfg.algo, tok, torch.device("cpu"), seed=SEED, mesh=mesh,
                                        trainable=trainable, groups=groups or {}))


def fsdp():
    return FSDPEngine(EngineContext("actor_train", FSDPArgs(share_prompts=False), cfg.model, cfg.algo, tok,
                                    torch.device("cpu"), seed=SEED, mesh=mesh_dp2, trainable=True))


def batch(step, rank=None):
    """This rank's samples (data parallel: each rank its own, unless ``rank`` names whose)."""
    g = torch.Generator().manual_seed(100 + step + 1000 * (comm.rank if rank is None else rank))
    return [{"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
             "response": torch.randint(4, 18, (1 + k % 5,), generator=g),
             "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(8)]


def train(e, steps):
    return policy_steps(e, steps, batch, policy)


def gap(xs, ys):
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys, strict=True))


# -- conversion and log-probs ----------------------------------------------------------------------
hf = load_model(cfg.model, tok, SEED)
hf_weights = {n: p.detach().clone() for n, p in hf.named_parameters()}
assert hf.config.num_experts == 4 and hf.config.num_experts_per_tok == 2
e1, e2, pp2, tp2 = engine(mesh_dp2), engine(mesh_dp2, EP2), engine(mesh_pp2), engine(mesh_tp2, trainable=False)
experts = [n for n in e2.params if ".mlp.experts.local_experts." in n and "layers.0." in n]
assert e2.ep == 2 and len(experts) == 4, f"e=2: each rank holds 2 experts (fc1 and fc2 each), got {experts}"
for name, e, own in (("e=1", e1, batch(0)), ("e=2", e2, batch(0)), ("p=2", pp2, batch(0, rank=0)),
                     ("forward-only t=2", tp2, batch(0, rank=0))):
    same(weights(e), hf_weights, f"HF -> GPTModel -> HF at {name}")
    same(weights(e, torch.bfloat16), bf16_like(hf_weights), f"bf16 export at {name}")
    b = pack(own, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        ref = unpack(algos.token_logprobs(response_logits(hf, b).float(), b.targets), b.lengths)
    err = gap(e.logprobs(own), ref)
    assert err < TOL, f"{name} log-probs differ from transformers' by {err}"
    print(f"rank {comm.rank}: {name} MoE log-probs within {err:.1e} of transformers'", flush=True)
del tp2

# -- a Qwen2-MoE model directory (model.path: transformers saves the experts one by one) --------------
if comm.rank == 0:
    hf.save_pretrained(TMP / "moe-dir")
    tok.save_pretrained(TMP / "moe-dir")
dist.barrier()
from_dir = engine(mesh_dp2, EP2, model=compose(["algo=ppo", f"model.path={TMP / 'moe-dir'}"]).model)
same(weights(from_dir), hf_weights, "a Qwen2-MoE directory -> GPTModel (e=2) -> HF")
del from_dir

# -- t=2 (sequence parallel) against p=2: one replica each, the same samples on both ranks ---------------
try:  # megatron-core trains MoE layers under tensor parallelism only with sequence parallelism
    engine(mesh_tp2, args=MegatronArgs(micro_batch=3, sequence_parallel=False))
except ValueError as err:
    assert "sequence parallelism only" in str(err), err
else:
    raise AssertionError("a trainable MoE engine at t=2 without sequence parallelism was built")
tp2 = engine(mesh_tp2)
tp2_distopt = engine(mesh_tp2, args=MegatronArgs(micro_batch=3, distributed_optimizer=True))
assert tp2.sp and tp2.model.config.sequence_parallel


def one_replica(e, steps):
    return policy_steps(e, steps, lambda step: batch(step, rank=0), policy)


want_stats = one_replica(pp2, range(4))
want = weights(pp2)
for name, e in (("t=2", tp2), ("t=2 distributed optimizer", tp2_distopt)):
    for step, (a, b) in enumerate(zip(one_replica(e, range(4)), want_stats, strict=True)):
        for key in ("pg_loss", "grad_norm"):
            assert abs(a[key] - b[key]) < TOL * max(1.0, abs(b[key])), f"step {step} {key}: {name} {a[key]} p=2 {b[key]}"
        print(f"rank {comm.rank}: step {step} pg_loss {name} {a['pg_loss']:.7f} p=2 {b['pg_loss']:.7f} grad_norm "
              f"{a['grad_norm']:.6f} {b['grad_norm']:.6f}", flush=True)
    got = weights(e)
    err = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert err < WEIGHT_TOL, f"after 4 updates {name} and p=2 weights differ by {err}"
    print(f"rank {comm.rank}: after 4 updates {name} (sequence parallel) weights within {err:.1e} of p=2's", flush=True)
del tp2, tp2_distopt, pp2

# -- training against the fsdp engine on the transformers model -------------------------------------
f = fsdp()
runs = {"fsdp": train(f, range(6)), "e=1": train(e1, range(6)), "e=2": train(e2, range(6))}
for step in range(6):
    want = runs["fsdp"][step]
    for name in ("e=1", "e=2"):
        got = runs[name][step]
        for key in ("pg_loss", "grad_norm"):
            assert abs(got[key] - want[key]) < TOL * max(1.0, abs(want[key])), \
                f"step {step} {name} {key}: {got[key]} against fsdp's {want[key]}"
    print(f"rank {comm.rank}: step {step} pg_loss fsdp {want['pg_loss']:.7f} e=1 {runs['e=1'][step]['pg_loss']:.7f} "
          f"e=2 {runs['e=2'][step]['pg_loss']:.7f} grad_norm {want['grad_norm']:.6f} "
          f"{runs['e=2'][step]['grad_norm']:.6f}", flush=True)
reference = weights(f)
for name, e in (("e=1", e1), ("e=2", e2)):
    got = weights(e)
    err = max(float((got[n] - reference[n]).abs().max()) for n in reference)
    moved = max(float((reference[n] - hf_weights[n]).abs().max()) for n in reference)
    assert err < WEIGHT_TOL < moved / 100, f"after 6 updates {name} and fsdp weights differ by {err} (moved {moved})"
    print(f"rank {comm.rank}: after 6 updates {name} weights within {err:.1e} of fsdp's (moved {moved:.1e})",
          flush=True)
trained = weights(e2)

# -- exact resume and checkpoints shared with fsdp at e=2 -------------------------------------------
resumes_exactly(lambda: engine(mesh_dp2, EP2), train, TMP / "ep3", trained, "e=2 resume 3+3 vs 6")
shares_checkpoints_with_fsdp(fsdp, lambda: engine(mesh_dp2, EP2), train, TMP, "megatron e=2")

dist.barrier()
if comm.rank == 0:
    shutil.rmtree(TMP, ignore_errors=True)
print(f"rank {comm.rank}: megatron moe ok", flush=True)
end_script(comm)
