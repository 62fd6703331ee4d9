"""Under mpiexec -n 4, the megatron engine's pipeline stages beside data parallelism (d2p2) on real
megatron-core (CPU, gloo, the test-only shim), with torch AdamW and with megatron-core's
distributed optimizer, against the single-stage engine on four data-parallel ranks (d4). Every
rank gets the same samples, so every configuration takes the same step; the gradient norm would
show a sum over dp where a mean is due (AdamW itself is blind to the scale):

- d2p2, plain optimizer: three updates with d4's losses and gradient norms, weights within float
  tolerance after;
- d2p2, distributed optimizer: each rank holds about half of its stage's AdamW state; the same
  losses, gradient norms and weights; the tied embedding's two copies equal; exact resume
  (3 + 3 == 6, bitwise); its checkpoint loads into the plain optimizer and into itself alike;
- a Qwen2-MoE at d2p2e2 (expert parallelism inside each stage) against the same model at d4;
- token budgets (``engine_args.max_tokens_per_micro_batch``): each replica trains its own share of a
  ragged global batch (shares of unequal sizes, the long responses on the first) in micro-batches of at most 24 or 40
  tokens, at d4 and at d2p2 (torch AdamW; the distributed optimizer: its gradient norm), padded
  rows (d4 at 40) and packed ones (``pack_rows``: the others, through the pipeline too), for the
  token-mean, sequence-mean and sequence-mean-of-token-sums aggregations: the gradient of the whole
  batch in one pass, to float32 rounding, where the same shares without a budget are off for the
  token mean; log-probs under a budget (the long share needing more forwards) equal one pass's.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import policy_steps, restore, resumes_exactly, same, trains_like, weights
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

import tests.plugins.megatron_cpu  # noqa: F401  (test-only CPU shim, installs itself)
from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.megatron import MegatronArgs
from rlbatch.engines.megatron import optim as megatron_optim
from rlbatch.engines.megatron.engine import MegatronEngine
from rlbatch.engines.model import load_tokenizer
from rlbatch.placement import subgroups

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
NAMES = ("pp", "dp", "cp", "tp")
mesh_d2p2 = DeviceMesh("cpu", torch.arange(4).reshape(2, 2, 1, 1), mesh_dim_names=NAMES)
mesh_d4 = DeviceMesh("cpu", torch.arange(4).reshape(1, 4, 1, 1), mesh_dim_names=NAMES)
cfg = compose(["algo.lr=1e-2", "algo.warmup_steps=2", "algo.grad_clip=0.5", "algo.grad_accum=2"])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)
TMP = Path(comm.bcast(tempfile.mkdtemp(prefix="mcore-ppdp-") if comm.rank == 0 else None, root=0))
TOL, WEIGHT_TOL = 1e-4, 1e-3
"""Stats: relative, float rounding ~1e-6 apart (a sum over dp doubles the gradient norm). Weights:
AdamW divides by sqrt(v), so rounding differences of the gradient sums grow over the updates
(~1e-5 here); the bound is 100x below how far they move (~0.1)."""


def engine(mesh, distributed=False, model=None, groups=None, budget=0, algo=None, packed=False):
    args = MegatronArgs(micro_batch=3, distributed_optimizer=distributed, max_tokens_per_micro_batch=budget,
                        pack_rows=packed)
    return MegatronEngine(EngineContext("actor_train", args, model or cfg.model, algo or cfg.algo, tok,
                                        torch.device("cpu"), seed=3, mesh=mesh, trainable=True, groups=groups or {}))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return [{"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
             "response": torch.randint(4, 18, (1 + k % 5,), generator=g),
             "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(8)]


def train(e, steps):
    return policy_steps(e, steps, batch, objective)


def agree(name, e, ref_stats, ref_weights):
    got, err = trains_like(name, e, train, ref_stats, ref_weights, TOL, WEIGHT_TOL)
    print(f"rank {comm.rank}: {name} grad norms {[round(s['grad_norm'], 5) for s in got]}, weights within {err:.1e} "
          "of d4's", flush=True)


d4 = engine(mesh_d4)
ref_stats = train(d4, range(3))
ref = weights(d4)
agree("d2p2 AdamW", engine(mesh_d2p2), ref_stats, ref)

sharded = engine(mesh_d2p2, distributed=True)
agree("d2p2 distributed optimizer", sharded, ref_stats, ref)
held = sum(t.numel() for t in megatron_optim.state_tensors(sharded.dist_opt))
full = 2 * sum(p.numel() for p in sharded.model.parameters())  # this stage's two AdamW moments
assert 0.4 < held / full < 0.6, f"rank {comm.rank} holds {held} of its stage's {full} AdamW elements"
tied = sharded.model.shared_embedding_or_output_weight().detach()
copies = [torch.empty_like(tied) for _ in range(4)]
dist.all_gather(copies, tied)
assert all(torch.equal(c, copies[0]) for c in copies), "the tied embedding's copies (two stages x two replicas) differ"

six = engine(mesh_d2p2, distributed=True)
train(six, range(6))
resumes_exactly(lambda: engine(mesh_d2p2, distributed=True), train, TMP / "do3", weights(six),
                "d2p2 distributed optimizer: resume 3+3 vs 6")
plain = engine(mesh_d2p2)
restore(plain, TMP / "do3")
half = engine(mesh_d2p2, distributed=True)
restore(half, TMP / "do3")
same(plain.checkpoint_state().tensors, half.checkpoint_state().tensors,
     "d2p2 distributed optimizer checkpoint into the plain optimizer")
# A Qwen2-MoE (4 experts) at d2p2e2: each stage's two replicas split the experts, 2 each (the
# expert groups world makes: ranks 0-1 on stage 0, 2-3 on stage 1), against the same model at d4.
moe = compose(["model.arch=qwen2_moe"]).model
groups = {"role": dist.new_group(list(range(4))),
          **subgroups.create(range(4), (("pp", 2), ("dp", 2), ("cp", 1), ("tp", 1)), comm.rank, dist.new_group, ep=2)}
moe_d4 = engine(mesh_d4, model=moe)
moe_stats = train(moe_d4, range(3))
agree("MoE d2p2e2", engine(mesh_d2p2, model=moe, groups=groups), moe_stats, weights(moe_d4))

# Token budgets. lr 0: the updates leave the weights where they were, so each engine trains every
# aggregation from the same weights, and the gradients it holds after are those of the initial ones.
budget_cfg = compose(["algo.lr=0", "algo.grad_clip=1e6", "algo.mini_batches=1", "algo.kl_coef=0", "algo.grad_accum=1"])
g = torch.Generator().manual_seed(7)
every = [{"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
          "response": torch.randint(4, 18, ((14 + k % 7) if k < 6 else (1 + k % 3),), generator=g),
          "advantage": torch.tensor(float(k % 5) - 1.5)} for k in range(16)]  # none 0: a repeat would count
for s in every:
    s["old_logprobs"] = -torch.rand(len(s["response"]), generator=g)
# Shares of unequal sizes: the ranks with few short samples must repeat one (with a zero loss) to
# run as many micro-batches as the rank with the long ones.
d4_share = [every[0:6], every[6:8], every[8:12], every[12:16]][comm.rank]
pp_share = [every[0:12], every[12:16]][comm.rank % 2]
n_tokens = sum(len(s["response"]) for s in every)
EPS32 = torch.finfo(torch.float32).eps
"""Tolerance: a float32 gradient summing N (response tokens) terms in another order, through other
padded shapes, moves by about N * eps32 of its largest terms (Higham's gamma_N): 8 * N * eps32 * max|g|."""


def full_grads(e):
    """The engine's gradients of the last update under HF names, whole (gathered over pp), one vector."""
    local = {n: (gr if (gr := e._grad(p)) is not None else torch.zeros_like(p)) for n, p in e.params.items()}
    full = e._gather(local)
    return torch.cat([full[n].reshape(-1) for n in sorted(full)])


AGGREGATIONS = {agg: PolicyObjective(compose([f"algo.loss_agg={agg}", "algo.kl_coef=0"]).algo)
                for agg in ("token", "seq", "seq_sum")}


def budget_step(e, samples, agg):
    return e.train(samples, AGGREGATIONS[agg])


ref = engine(mesh_d4, algo=budget_cfg.algo)
budgeted = {f"d4 budget {b}": (engine(mesh_d4, budget=b, algo=budget_cfg.algo, packed=b == 24), d4_share) for b in (24, 40)}
budgeted["d2p2 budget 24"] = (engine(mesh_d2p2, budget=24, algo=budget_cfg.algo, packed=True), pp_share)
assert all(e.packed == ("24" in name) for name, (e, _) in budgeted.items())
sliced = engine(mesh_d2p2, distributed=True, budget=40, algo=budget_cfg.algo, packed=True)
for agg in AGGREGATIONS:
    want_norm = budget_step(ref, every, agg)["grad_norm"]  # every rank the whole batch in one micro-batch
    want = full_grads(ref)
    tol = 8 * n_tokens * EPS32 * float(want.abs().max())
    errs = []
    for name, (e, mine) in budgeted.items():
        budget_step(e, mine, agg)
        errs.append(float((full_grads(e) - want).abs().max()))
        assert errs[-1] <= tol, f"{agg}, {name}: gradient {errs[-1]:.3g} from one pass's (tolerance {tol:.3g})"
    norm = budget_step(sliced, pp_share, agg)["grad_norm"]
    assert abs(norm - want_norm) <= 1e-5 * want_norm, f"{agg}, d2p2 distributed optimizer budget 40: norm {norm} vs {want_norm}"
    if agg == "token":  # each rank's own token mean, averaged over ranks: not the whole batch's
        budget_step(ref, d4_share, agg)
        off = float((full_grads(ref) - want).abs().max())
        print(f"rank {comm.rank}: token mean without a budget: {off:.3g} off", flush=True)
        assert off > 20 * tol, f"without a budget the shares' gradient is {off:.3g} from one pass's: the test cannot fail"
    print(f"rank {comm.rank}: {agg}: budgets give one pass's gradient within {max(errs):.1e} (tolerance {tol:.1e}), "
          f"the distributed optimizer's norm {norm:.6f} vs {want_norm:.6f}", flush=True)
lean, (pp24, _) = budgeted["d4 budget 24"][0], budgeted["d2p2 budget 24"]
for e, mine in ((lean, d4_share), (pp24, pp_share)):
    want_lp = ref.logprobs(mine)
    got_lp = e.logprobs(mine)
    lp_tol = 8 * n_tokens * EPS32 * max(float(x.abs().max()) for x in want_lp)
    assert len(got_lp) == len(mine) and all(a.shape == b.shape and float((a - b).abs().max()) <= lp_tol
                                            for a, b in zip(got_lp, want_lp, strict=True)), "log-probs under a budget"

dist.barrier()
if comm.rank == 0:
    shutil.rmtree(TMP, ignore_errors=True)
print(f"rank {comm.rank}: megatron pipeline with data parallelism ok", flush=True)
end_script(comm)
