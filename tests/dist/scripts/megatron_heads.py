"""Under mpiexec -n 2, the megatron engine's scalar heads on real megatron-core (CPU, gloo, the
test-only shim), against transformers and the fsdp engine:

- a critic (a token-classification model with a random head, loaded from a directory) at TP=2:
  values within float tolerance of transformers' ``...ForTokenClassification``;
- a few value-objective updates at TP=2 and with fsdp from the same weights and samples (some
  responses with the pad token inside, whose embedding row transformers does not train through the
  lookup): the same losses and, after them, the same values (float tolerance);
- the TP=2 critic's checkpoint loads into the fsdp critic (same weights, bitwise), into the
  exporter's token-classification model (``rlbatch.export``), and the fsdp critic's back into TP=2;
- a reward model (sequence classification) at TP=2: scores within float tolerance of transformers';
- under a token budget (``engine_args.max_tokens_per_micro_batch``, one or two samples per
  micro-batch) with packed rows (``pack_rows``; the reward model's whole sequences back to back, each
  scored at its last token that is not the pad token): the critic's values and the reward model's
  scores as above, and the critic's first updates give the unbudgeted engine's value losses and
  gradient norms.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import checkpoint, critic_directory, restore, same, scores_like_transformers, weights
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

import tests.plugins.megatron_cpu  # noqa: F401  (test-only CPU shim, installs itself)
from rlbatch.algos.value import ValueObjective
from rlbatch.checkpoint.hf_export import load_weights
from rlbatch.config.compose import compose
from rlbatch.engines import training as common
from rlbatch.engines.base import EngineContext
from rlbatch.engines.batch import pack
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.megatron import MegatronArgs
from rlbatch.engines.megatron.engine import MegatronEngine
from rlbatch.engines.model import load_model, load_tokenizer, value_model

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
NAMES = ("pp", "dp", "cp", "tp")
mesh_tp2 = DeviceMesh("cpu", torch.arange(2).reshape(1, 1, 1, 2), mesh_dim_names=NAMES)
mesh_dp2 = DeviceMesh("cpu", torch.arange(2).reshape(1, 2, 1, 1), mesh_dim_names=NAMES)
cfg = compose(["algo=ppo", "algo.lr=1e-3", "algo.warmup_steps=0", "algo.grad_clip=1.0"])
tok = load_tokenizer(cfg.model)
SEED = 3
TMP = Path(comm.bcast(tempfile.mkdtemp(prefix="mcore-heads-") if comm.rank == 0 else None, root=0))
TOL = 1e-4
"""fp32 with |values| ~ 1: the engines sum in other orders (TP-split matmuls, fused qkv), ~1e-6
apart; a wrong mapping or a head read at the wrong position is off by ~0.1 or more."""

critic_model = critic_directory(cfg, tok, SEED, TMP / "critic")


def engine(cls, args, mesh, head, trainable=True, model=critic_model):
    return cls(EngineContext("critic" if head == "value" else "reward", args, model, cfg.algo, tok,
                             torch.device("cpu"), seed=SEED, mesh=mesh, trainable=trainable, head=head))


def batch(step):
    """The same samples on both ranks, with the critic's targets (returns) and old values."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for k in range(8):
        n = 1 + k % 5
        response = torch.randint(4, 18, (n,), generator=g)
        if n > 2 and k % 2:  # a sampled pad token inside a response: its row learns nothing from the lookup
            response[1] = tok.pad_token_id
        out.append({"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
                    "response": response,
                    "returns": torch.randn(n, generator=g), "values": torch.zeros(n)})
    return out


def gap(xs, ys):
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys, strict=True))


# -- critic: values against transformers ----------------------------------------------------------
from transformers import AutoModelForTokenClassification  # noqa: E402

ref = AutoModelForTokenClassification.from_pretrained(TMP / "critic").eval()
samples = batch(0)
want = common.values(ref, samples, 0, lambda c: pack(c, tok.pad_token_id, torch.device("cpu"), share_prompts=False))
mc = engine(MegatronEngine, MegatronArgs(), mesh_tp2, "value")
err = gap(mc.values(samples), want)
assert err < TOL, f"TP=2 values differ from transformers by {err}"
assert max(float(v.abs().max()) for v in want) > 0.1, "the reference values are trivial"
print(f"rank {comm.rank}: TP=2 critic values within {err:.1e} of transformers", flush=True)
BUDGET = MegatronArgs(max_tokens_per_micro_batch=12, pack_rows=True)
budgeted = engine(MegatronEngine, BUDGET, mesh_tp2, "value")
err = gap(budgeted.values(samples), want)
assert err < TOL, f"TP=2 values under a token budget differ from transformers by {err}"

# -- critic: training against fsdp ----------------------------------------------------------------
fs = engine(FSDPEngine, FSDPArgs(share_prompts=False), mesh_dp2, "value")
objective = ValueObjective(cfg.algo)
for step in range(3):
    s_m, s_f = batch(step), batch(step)
    stats_m, stats_f = mc.train(s_m, objective), fs.train(s_f, objective)
    if step == 0:  # from the same weights, the budget's micro-batches give the same updates
        stats_b = budgeted.train(batch(step), objective)
        for key in ("value_loss", "grad_norm"):
            d = abs(stats_b[key] - stats_m[key])
            assert d < TOL * max(1.0, abs(stats_m[key])), f"{key} under a token budget {stats_b[key]}, without {stats_m[key]}"
        print(f"rank {comm.rank}: under a token budget value_loss {stats_b['value_loss']:.7f} grad_norm "
              f"{stats_b['grad_norm']:.6f}", flush=True)
    for key in ("value_loss", "grad_norm"):
        d = abs(stats_m[key] - stats_f[key])
        assert d < TOL * max(1.0, abs(stats_f[key])), f"step {step} {key}: megatron {stats_m[key]} fsdp {stats_f[key]}"
    print(f"rank {comm.rank}: step {step} value_loss megatron {stats_m['value_loss']:.7f} fsdp "
          f"{stats_f['value_loss']:.7f} grad_norm {stats_m['grad_norm']:.6f} {stats_f['grad_norm']:.6f}", flush=True)
err = gap(mc.values(batch(9)), fs.values(batch(9)))
assert err < TOL, f"after 3 updates TP=2 and fsdp values differ by {err}"
print(f"rank {comm.rank}: after 3 updates TP=2 and fsdp critic values within {err:.1e}", flush=True)

# -- critic checkpoints: megatron -> fsdp, -> the exporter's model, fsdp -> megatron ---------------
checkpoint(mc, TMP / "mc")
f2 = engine(FSDPEngine, FSDPArgs(share_prompts=False), mesh_dp2, "value")
restore(f2, TMP / "mc")
trained = weights(mc)
same(weights(f2), trained, "TP=2 critic checkpoint into fsdp")
assert "score.weight" in trained and "score.bias" in trained and "lm_head.weight" not in trained
exported = value_model(load_model(cfg.model, tok, SEED + 1))
load_weights(TMP / "mc", exported)
same({n: p.detach() for n, p in exported.named_parameters()}, trained, "TP=2 critic checkpoint as exported")
checkpoint(fs, TMP / "fs")
m2 = engine(MegatronEngine, MegatronArgs(), mesh_tp2, "value")
restore(m2, TMP / "fs")
same(weights(m2), weights(fs), "fsdp critic checkpoint into TP=2")
m2.train(batch(5), objective), fs.train(batch(5), objective)  # the Adam state came along
err = gap(m2.values(batch(9)), fs.values(batch(9)))
assert err < TOL, f"one update after the cross-engine load, TP=2 and fsdp values differ by {err}"

# -- reward model: scores against transformers -----------------------------------------------------
scores_like_transformers(engine(MegatronEngine, MegatronArgs(), mesh_tp2, "reward", trainable=False, model=cfg.model),
                         cfg, tok, SEED, samples, TOL, "TP=2")
scores_like_transformers(engine(MegatronEngine, BUDGET, mesh_tp2, "reward", trainable=False, model=cfg.model),
                         cfg, tok, SEED, samples, TOL, "TP=2 under a token budget")

dist.barrier()
if comm.rank == 0:
    shutil.rmtree(TMP, ignore_errors=True)
print(f"rank {comm.rank}: megatron heads ok", flush=True)
end_script(comm)
