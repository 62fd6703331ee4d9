"""Under mpiexec -n 2, the megatron engine's pipeline parallelism on real megatron-core (CPU, gloo,
the test-only shim): p=2, one layer of the tiny model per stage, its tied embedding held by both
stages (the lookup on the first, the output layer on the last). Against the single-stage engine
(TP=1, the same samples on both ranks) and transformers:

- HF -> two stages -> HF is exact (export gives the HF weights bit for bit, on both stages);
- PP=2 log-probs, three micro-batches of different shapes through the 1F1B schedule, equal TP=1's
  and transformers' within float tolerance, on both stages;
- six updates (two mini-batches of two gradient-accumulation micro-batches each per step) at PP=2
  and TP=1 from the same weights and samples: the same losses and gradient norms on every rank,
  weights within float tolerance after, and the two copies of the tied embedding still equal;
- exact resume at PP=2: 3 steps, checkpoint through the DCP store, 3 more == 6 steps, bitwise;
- an fsdp checkpoint loads into PP=2 (weights and Adam moments bitwise) and PP=2's back into fsdp;
- a PP=2 critic (value head, untied) gives TP=1's values and trains like it; a PP=2 reward model's
  scores equal transformers'.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import (
    bf16_like,
    critic_directory,
    policy_steps,
    resumes_exactly,
    same,
    scores_like_transformers,
    shares_checkpoints_with_fsdp,
    weights,
)
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

import tests.plugins.megatron_cpu  # noqa: F401  (test-only CPU shim, installs itself)
from rlbatch import algos
from rlbatch.algos.objective import PolicyObjective
from rlbatch.algos.value import ValueObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.batch import pack, response_logits, unpack
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.megatron import MegatronArgs
from rlbatch.engines.megatron.engine import MegatronEngine
from rlbatch.engines.model import load_model, load_tokenizer

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
NAMES = ("pp", "dp", "cp", "tp")
mesh_pp2 = DeviceMesh("cpu", torch.arange(2).reshape(2, 1, 1, 1), mesh_dim_names=NAMES)
mesh_dp2 = DeviceMesh("cpu", torch.arange(2).reshape(1, 2, 1, 1), mesh_dim_names=NAMES)
cfg = compose(["algo=ppo", "algo.lr=1e-2", "algo.warmup_steps=2", "algo.grad_clip=0.5", "algo.mini_batches=2",
               "algo.grad_accum=2"])
tok = load_tokenizer(cfg.model)
policy, value = PolicyObjective(cfg.algo), ValueObjective(cfg.algo)
SEED = 3
TMP = Path(comm.bcast(tempfile.mkdtemp(prefix="mcore-pp-") if comm.rank == 0 else None, root=0))
TOL = 1e-4
"""fp32 with |logp| ~ 3 and values ~ 1: the stages sum in the same order as one rank, the TP=1
engine and transformers differ by ~1e-6; a layer on the wrong stage, a lost micro-batch or an
unsynchronised tied embedding is off by ~0.1 or more."""
WEIGHT_TOL = 1e-3


def engine(mesh, trainable=True, head="lm", model=None, micro_batch=3):
    role = {"lm": "actor_train", "value": "critic", "reward": "reward"}[head]
    return MegatronEngine(EngineContext(role, MegatronArgs(micro_batch=micro_batch), model or cfg.model, cfg.algo,
                                        tok, torch.device("cpu"), seed=SEED, mesh=mesh, trainable=trainable, head=head))


def batch(step):
    """The same samples on both ranks (the stages of one replica and the TP=1 replicas alike)."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for k in range(8):
        n = 1 + k % 5
        out.append({"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
                    "response": torch.randint(4, 18, (n,), generator=g),
                    "advantage": torch.tensor(float(k % 5) - 2.0),
                    "returns": torch.randn(n, generator=g), "values": torch.zeros(n)})
    return out


def gap(xs, ys):
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys, strict=True))


def train(e, steps, objective=policy):
    if objective is policy:
        return policy_steps(e, steps, batch, policy)
    return [e.train(batch(s), objective) for s in steps]


def close(a, b, what):
    for key in ("pg_loss", "value_loss", "grad_norm"):
        if key in b:
            assert abs(a[key] - b[key]) < TOL * max(1.0, abs(b[key])), f"{what} {key}: PP=2 {a[key]} TP=1 {b[key]}"


def on_every_rank(x, what):
    xs = comm.allgather(x)
    assert all(y == xs[0] for y in xs), f"{what} differs between the ranks: {xs}"


# -- conversion and log-probs ----------------------------------------------------------------------
hf = load_model(cfg.model, tok, SEED)
hf_weights = {n: p.detach().clone() for n, p in hf.named_parameters()}
assert hf.config.tie_word_embeddings and hf.config.num_hidden_layers == 2
pp2, tp1 = engine(mesh_pp2), engine(mesh_dp2)
assert pp2.stage == comm.rank and len(pp2.model.decoder.layers) == 1
same(weights(pp2), hf_weights, "HF -> GPTModel -> HF at PP=2")
same(weights(pp2, torch.bfloat16), bf16_like(hf_weights), "bf16 export at PP=2")
samples = batch(0)
b = pack(samples, tok.pad_token_id, torch.device("cpu"))
with torch.no_grad():
    ref = unpack(algos.token_logprobs(response_logits(hf, b).float(), b.targets), b.lengths)
got = pp2.logprobs(samples)
for name, want in (("TP=1", tp1.logprobs(samples)), ("transformers", ref)):
    err = gap(got, want)
    assert err < TOL, f"PP=2 log-probs differ from {name}'s by {err}"
    print(f"rank {comm.rank}: PP=2 log-probs within {err:.1e} of {name}'s", flush=True)
on_every_rank([x.tolist() for x in got], "PP=2 log-probs")

# -- training against the single-stage engine -------------------------------------------------------
for step, (a, b1) in enumerate(zip(train(pp2, range(6)), train(tp1, range(6)), strict=True)):
    close(a, b1, f"step {step}")
    on_every_rank(a, f"step {step} stats")
    print(f"rank {comm.rank}: step {step} pg_loss PP=2 {a['pg_loss']:.7f} TP=1 {b1['pg_loss']:.7f} "
          f"grad_norm {a['grad_norm']:.6f} {b1['grad_norm']:.6f}", flush=True)
trained, single = weights(pp2), weights(tp1)
err = max(float((trained[n] - single[n]).abs().max()) for n in single)
moved = max(float((trained[n] - hf_weights[n]).abs().max()) for n in single)
# AdamW divides by sqrt(v), so rounding differences of the gradient sums (the tied embedding's two
# copies are added in another order than one rank's autograd adds them) grow over the updates:
# 3.9e-5 after six at lr 1e-2 here; the bound is 100x below how far the weights moved (0.11).
assert err < WEIGHT_TOL < moved / 100, f"after 6 updates PP=2 and TP=1 weights differ by {err} (moved {moved})"
print(f"rank {comm.rank}: after 6 updates PP=2 weights within {err:.1e} of TP=1's (moved {moved:.1e})", flush=True)
tied = pp2.model.shared_embedding_or_output_weight().detach()
copies = [torch.empty_like(tied) for _ in range(2)]
dist.all_gather(copies, tied)
assert torch.equal(copies[0], copies[1]), "the tied embedding's two copies drifted apart"

# -- exact resume at PP=2: 3 + 3 == 6 -------------------------------------------------------------
resumes_exactly(lambda: engine(mesh_pp2), train, TMP / "pp3", trained, "PP=2 resume 3+3 vs 6")

# -- fsdp <-> megatron PP=2 checkpoints -------------------------------------------------------------
shares_checkpoints_with_fsdp(
    lambda: FSDPEngine(EngineContext("actor_train", FSDPArgs(share_prompts=False), cfg.model, cfg.algo, tok,
                                     torch.device("cpu"), seed=SEED, mesh=mesh_dp2, trainable=True)),
    lambda: engine(mesh_pp2), train, TMP, "megatron PP=2")

# -- critic and reward model at PP=2 -------------------------------------------------------------
critic_model = critic_directory(cfg, tok, SEED, TMP / "critic")
c_pp, c_tp = engine(mesh_pp2, head="value", model=critic_model), engine(mesh_dp2, head="value", model=critic_model)
err = gap(c_pp.values(batch(0)), c_tp.values(batch(0)))
assert err < TOL and max(float(v.abs().max()) for v in c_tp.values(batch(0))) > 0.1, f"PP=2 values differ by {err}"
for step, (a, b1) in enumerate(zip(train(c_pp, range(2), value), train(c_tp, range(2), value), strict=True)):
    close(a, b1, f"critic step {step}")
err = gap(c_pp.values(batch(9)), c_tp.values(batch(9)))
assert err < TOL, f"after 2 updates the PP=2 and TP=1 critics' values differ by {err}"
print(f"rank {comm.rank}: PP=2 critic values within {err:.1e} of TP=1's after 2 updates", flush=True)
got_scores = scores_like_transformers(engine(mesh_pp2, trainable=False, head="reward"), cfg, tok, SEED, samples, TOL,
                                      "PP=2")
on_every_rank(got_scores, "PP=2 scores")

dist.barrier()
if comm.rank == 0:
    shutil.rmtree(TMP, ignore_errors=True)
print(f"rank {comm.rank}: megatron pipeline ok", flush=True)
end_script(comm)
