"""Under mpiexec -n 2 (fsdp:d1t2 against fsdp:d2) or -n 4 (fsdp:d2t2 against fsdp:d4; with the argument
``equality-only``, the first two checks alone, over one update): the fsdp
engine with tensor parallelism on the tp axis trains like the same engine with data parallelism
alone, on the same global batch. With the argument ``cp``, the same checks of context parallelism
(fsdp:d1c2 against fsdp:d2: Ulysses, each packed row split over the cp axis) in place of tp; with
``cp-tp`` (4 ranks, with ``equality-only``), both: fsdp:d1t2c2 against fsdp:d4. With ``lora`` (and
``equality-only``), the policy learns low-rank adapters (model.lora.rank=4) under both layouts: the
adapters' A whole and B split on column-split layers, A split and B whole on row-split ones.

- at start-up both export the same weights, bit for bit (each rank filled its 2-D block by rows);
- three updates: losses and gradient norms (clipped: the norm spans both meshes, dp x tp and dp)
  equal to float32 rounding, the first update's gradients too, and so do the log-probs after them;
- a value model read from a model directory gives the same values;
- a checkpoint of the data-parallel engine loads into the tensor-parallel one (weights bitwise,
  log-probs as the saver's) and one written by the tensor-parallel engine loads back (weights
  bitwise): DCP reshards between the layouts;
- at tp, 3 + 3 updates through a checkpoint equal 6 in one go, bit for bit (``resumes_exactly``);
- offload and reload of the tensor-parallel state is bit exact (training after it equals training
  without it: the resume check runs on an engine that was offloaded).

Every update runs under a token budget (packed rows, full-length position_ids) that holds a rank's
whole share (one micro-batch): the loss is then the whole batch's under any data-parallel split, so
d and dXtY see the same gradient, and the mean of the ranks' loss stats is the batch's loss.
Tolerance: float32 sums of ~300 token terms and of the tp partial sums taken in another order
differ by ~N * eps32 relative: 1e-5 relative on the loss, the norm and the gradients (a wrong split
or a missing all-reduce is off by ~1e-2 or more). The weights after three Adam steps are compared
to 1e-3 only: Adam moves an element by ~lr (1e-2) whatever its gradient's size, so where a
gradient is near Adam's eps (1e-8) float32 rounding of it sets a visible share of that step
(up to ~2e-4 seen); the log-probs under those weights agree to 1e-4.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import (
    checkpoint,
    critic_directory,
    policy_steps,
    restore,
    resumes_exactly,
    same,
    scores_like_transformers,
    weights,
)
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.engines.offload import local_tensor

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
N, NAMES = comm.size, ("pp", "dp", "cp", "tp")
mesh_d = DeviceMesh("cpu", torch.arange(N).reshape(1, N, 1, 1), mesh_dim_names=NAMES)
CP, BOTH = "cp" in sys.argv[2:], "cp-tp" in sys.argv[2:]
LAYOUT = (1, N // 4, 2, 2) if BOTH else (1, N // 2, 2, 1) if CP else (1, N // 2, 1, 2)
mesh_tp = DeviceMesh("cpu", torch.arange(N).reshape(LAYOUT), mesh_dim_names=NAMES)
LORA = "lora" in sys.argv[2:]
cfg = compose(["algo.lr=1e-2", "algo.warmup_steps=2", "algo.grad_clip=0.5", "algo.mini_batches=1",
               *(["model.lora.rank=4", "model.lora.alpha=8"] if LORA else [])])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)
SEED = 3
TMP = Path(comm.bcast(tempfile.mkdtemp(prefix="fsdp-tp-") if comm.rank == 0 else None, root=0))
ARGS = FSDPArgs(share_prompts=False, max_tokens_per_micro_batch=100)
D, TP = f"fsdp:d{N}", f"fsdp:d{N // 4}t2c2" if BOTH else f"fsdp:d{N // 2}{'c2' if CP else 't2'}"
QUICK = "equality-only" in sys.argv[2:]


def end(comm):
    dist.barrier()
    if comm.rank == 0:
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"rank {comm.rank}: fsdp tp ok", flush=True)
    end_script(comm)


def engine(mesh):
    return FSDPEngine(EngineContext("actor_train", ARGS, cfg.model, cfg.algo, tok, torch.device("cpu"),
                                    seed=SEED, mesh=mesh, trainable=True))


def global_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return [{"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
             "response": torch.randint(4, 18, (1 + k % 5,), generator=g),
             "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(8)]


def share(mesh):
    """This rank's samples: its dp rank's slice; the tp peers of one dp rank get the same ones."""
    dp, rank = mesh.size(1), mesh.get_local_rank("dp")
    return lambda step: global_batch(step)[rank::dp]


def train(e, mesh, steps):
    return policy_steps(e, steps, share(mesh), objective)


def world_mean(v, mesh, step):
    """A stat of the whole batch: each rank's is the token mean over its dp share (one micro-batch),
    so their mean weighted by the shares' response tokens (tp peers alike) is the batch's."""
    w = float(sum(len(s["response"]) for s in share(mesh)(step)))
    x = torch.tensor([v * w, w], dtype=torch.float64)
    dist.all_reduce(x)
    return float(x[0] / x[1])


def grads(e):
    """The full gradient of every parameter (those of the last update, read before the next)."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in e.model.named_parameters() if p.requires_grad}


def close(a, b, tol, what):
    assert a.keys() == b.keys(), f"{what}: names differ"
    err = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert err < tol, f"{what}: differ by {err}"
    return err


def logprobs(e, mesh, values=False):
    """The log-probs (a value model's values) of the whole batch, gathered over the dp ranks in batch order."""
    mine = (e.values if values else e.logprobs)(share(mesh)(0))
    parts = [None] * N
    dist.all_gather_object(parts, [t.tolist() for t in mine])
    dp = mesh.size(1)
    by_dp = [parts[r] for r in range(0, N, N // dp)]  # the first rank of each dp rank
    out = [None] * 8
    for k in range(dp):
        out[k::dp] = by_dp[k]
    return torch.tensor([x for lp in out for x in lp])


d, t = engine(mesh_d), engine(mesh_tp)
same(weights(t), weights(d), f"{TP} vs {D} weights at start")
hf = {n: p.detach() for n, p in load_model(cfg.model, tok, SEED).named_parameters()}
same({n: x for n, x in weights(t).items() if n in hf}, hf, f"{TP} weights at start vs transformers'")
if LORA:  # the adapters are what trains, and the split layers carry them
    trained = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained), trained
    assert any("lora_B" in n and "q_proj" in n and hasattr(p, "full_tensor") and p.to_local().shape != p.shape
               for n, p in t.model.named_parameters()), "q_proj's lora_B is not split over tp"
sd, st = train(d, mesh_d, range(1)), train(t, mesh_tp, range(1))
gd, gt = grads(d), grads(t)
scale = max(float(g.abs().max()) for g in gd.values())
err_g = close(gt, gd, 1e-5 * scale, f"{TP} vs {D} gradients of the first update") / scale
UPDATES = 1 if QUICK else 3
sd += train(d, mesh_d, range(1, UPDATES))
st += train(t, mesh_tp, range(1, UPDATES))
for k, (a, b) in enumerate(zip(sd, st, strict=True)):
    for key in ("pg_loss", "kl_ref", "entropy", "grad_norm"):
        x, y = world_mean(a[key], mesh_d, k), world_mean(b[key], mesh_tp, k)
        assert abs(x - y) <= 1e-5 * max(abs(x), 1e-2), f"update {k} {key}: {D} {x} vs {TP} {y}"
assert sd[0]["grad_norm"] > 0.5, f"the gradient norm {sd[0]['grad_norm']} is not clipped (grad_clip 0.5): a weak check"
err_w = close(weights(t), weights(d), 1e-3, f"{TP} vs {D} weights after {UPDATES} updates")
lp_d = logprobs(d, mesh_d)
err_lp = float((logprobs(t, mesh_tp) - lp_d).abs().max())
assert err_lp < 1e-4, f"{TP} vs {D} log-probs after {UPDATES} updates differ by {err_lp}"
print(f"rank {comm.rank}: {TP} == {D}: pg losses {[round(s['pg_loss'], 6) for s in st]}, grad norms "
      f"{[round(s['grad_norm'], 6) for s in st]}, gradients within {err_g:.1e} relative, weights within {err_w:.1e}, log-probs within {err_lp:.1e}", flush=True)

if QUICK:  # the 4-rank run: the layouts' numerics; the rest is the 2-rank run's
    end(comm)

# -- a value model read from a directory (safetensors rows, then columns at tp): the same values ------
critic = critic_directory(cfg, tok, SEED, TMP / "critic")
v_d, v_tp = (logprobs(FSDPEngine(EngineContext("critic", ARGS, critic, cfg.algo, tok, torch.device("cpu"), seed=SEED,
                                               mesh=m, head="value")), m, values=True) for m in (mesh_d, mesh_tp))
err_v = float((v_tp - v_d).abs().max())
assert err_v < 1e-5 and float(v_d.std()) > 1e-3, f"{TP} vs {D} critic values differ by {err_v} (std {float(v_d.std())})"

# -- context parallelism: a reward model scores each sample at its last token, wherever it falls --------
if CP:
    rm = FSDPEngine(EngineContext("reward", ARGS, cfg.model, cfg.algo, tok, torch.device("cpu"), seed=SEED,
                                  mesh=mesh_tp, head="reward"))
    scores_like_transformers(rm, cfg, tok, SEED, global_batch(0), 1e-4, TP)

# -- checkpoints across layouts: d -> dXt2 -> d ------------------------------------------------------
checkpoint(d, TMP / "d3")
t2 = engine(mesh_tp)
restore(t2, TMP / "d3")
same(weights(t2), weights(d), f"{D} checkpoint into {TP}: weights")
err_ck = float((logprobs(t2, mesh_tp) - lp_d).abs().max())
assert err_ck < 1e-4, f"{D} checkpoint into {TP}: log-probs differ by {err_ck}"
train(t2, mesh_tp, range(3, 4))
checkpoint(t2, TMP / "t4")
d2 = engine(mesh_d)
restore(d2, TMP / "t4")
same(weights(d2), weights(t2), f"{TP} checkpoint into {D}: weights")

# -- offload/reload, then exact resume at tp: 3 + 3 == 6 ----------------------------------------------
kinds = t.state_kinds
t.model.reshard()  # the log-probs' forward left the root unit gathered (FSDP keeps it for a backward)
t.offload(kinds)
assert all(local_tensor(p).untyped_storage().nbytes() == 0 for p in t.model.parameters()), "offload freed nothing"
t.reload(kinds)
train(t, mesh_tp, range(3, 6))
resumes_exactly(lambda: engine(mesh_tp), lambda e, steps: train(e, mesh_tp, steps), TMP / "tp3", weights(t),
                f"{TP} resume 3+3 vs 6 (the 6 through an offload)")
end(comm)
