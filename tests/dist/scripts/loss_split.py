"""Under mpiexec -n 2: FSDP training with a token budget (engine_args.max_tokens_per_micro_batch)
on each rank's half of a ragged batch (rank 0 the long responses, rank 1 the short ones) gives the
gradient of the whole batch in one pass, for the token-mean and the sequence-mean aggregations;
the count split (grad_accum micro-batches, each a mean over itself, ranks averaged) does not for
the token mean. DeepSpeed (ZeRO-2, which reduces and partitions the gradients itself) under the
same budgets steps with that one pass's gradient too, and with its count split does not. Log-probs under the budget (more forwards on rank 0 than rank 1 would need) equal
the padded ones, in order.

The reference trains the whole batch on both ranks in one padded micro-batch (mean over every
sample on each rank, averaged over two equal ranks: the global mean). Gradients are read after
one update (mini_batches=1, epochs=1, no clipping): they are those of the initial weights.
Tolerance: float32 sums of N ~ 300 token terms taken in another order and through other kernels
(packed rows vs padded ones) differ by about N * eps32 relative (gamma_N), so 8 * N * eps32 * max|g|."""

import sys

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.deepspeed import DeepSpeedArgs
from rlbatch.engines.deepspeed.engine import DeepSpeedEngine
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.model import load_tokenizer

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
mesh = DeviceMesh("cpu", torch.arange(comm.size), mesh_dim_names=("dp",))
ds_mesh = DeviceMesh("cpu", torch.arange(comm.size).reshape(1, comm.size, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))


def grads(args: FSDPArgs, samples: list[dict[str, torch.Tensor]], cfg: object) -> torch.Tensor:
    e = FSDPEngine(EngineContext("actor_train", args, cfg.model, cfg.algo, tok, torch.device("cpu"),  # type: ignore[attr-defined]
                                 seed=3, mesh=mesh, trainable=True))
    e.train(samples, PolicyObjective(cfg.algo))  # type: ignore[attr-defined]
    return torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).reshape(-1)
                      for p in e.model.parameters()])


def ds_grads(args: DeepSpeedArgs, samples: list[dict[str, torch.Tensor]], cfg: object) -> torch.Tensor:
    """The full gradient DeepSpeed steps with (reduced over the dp ranks, gathered from its ZeRO-2
    partitions by ``safe_get_full_grad`` between the last backward and the step)."""
    from deepspeed.utils import safe_get_full_grad

    e = DeepSpeedEngine(EngineContext("actor_train", args, cfg.model, cfg.algo, tok, torch.device("cpu"),  # type: ignore[attr-defined]
                                      seed=3, mesh=ds_mesh, trainable=True))
    seen: list[torch.Tensor] = []
    step = e.engine.step

    def read_then_step(*a: object, **k: object) -> object:
        seen.append(torch.cat([safe_get_full_grad(p).reshape(-1) for p in e.engine.module.parameters()]))
        return step(*a, **k)

    e.engine.step = read_then_step
    e.train(samples, PolicyObjective(cfg.algo))  # type: ignore[attr-defined]
    (got,) = seen
    return got


g = torch.Generator().manual_seed(0)
every = [{"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
          "response": torch.randint(4, 18, ((14 + k % 5) if k < 6 else (1 + k % 2),), generator=g),
          "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(12)]
for s in every:
    s["old_logprobs"] = -torch.rand(len(s["response"]), generator=g)
mine = every[:6] if comm.rank == 0 else every[6:]
n_tokens = sum(len(s["response"]) for s in every)
for agg in ("token", "seq"):
    base = ["algo.mini_batches=1", "algo.epochs=1", "algo.grad_clip=0", f"algo.loss_agg={agg}", "algo.kl_coef=0"]
    tok = load_tokenizer(compose(base).model)
    want = grads(FSDPArgs(), every, compose([*base, "algo.grad_accum=1"]))
    tol = 8 * n_tokens * torch.finfo(torch.float32).eps * float(want.abs().max())
    for budget in (24, 40):
        got = grads(FSDPArgs(max_tokens_per_micro_batch=budget), mine, compose([*base, "algo.grad_accum=3"]))
        err = float((got - want).abs().max())
        assert err <= tol, f"{agg}, budget {budget}: max diff {err:.3g} > {tol:.3g}"
    if agg == "token":  # a sequence mean over equal-count micro-batches is exact under the count split too
        naive = grads(FSDPArgs(), mine, compose([*base, "algo.grad_accum=3"]))
        assert float((naive - want).abs().max()) > 20 * tol, "the count split matched too (the test cannot fail)"
    for budget in (24, 40):
        got = ds_grads(DeepSpeedArgs(zero_stage=2, max_tokens_per_micro_batch=budget), mine,
                       compose([*base, "algo.grad_accum=3"]))
        err = float((got - want).abs().max())
        assert err <= tol, f"deepspeed {agg}, budget {budget}: max diff {err:.3g} > {tol:.3g}"
    if agg == "token":
        naive = ds_grads(DeepSpeedArgs(zero_stage=2, max_tokens_per_micro_batch=0), mine, compose([*base, "algo.grad_accum=3"]))
        assert float((naive - want).abs().max()) > 20 * tol, "deepspeed's count split matched too (the test cannot fail)"
# Forward-only: rank 0's long samples need more forwards than rank 1's short ones; both ranks make
# as many (else FSDP's gathers would pair up wrongly and hang) and the log-probs come back in order.
cfg = compose(["algo.kl_coef=0"])
lean, padded = (FSDPEngine(EngineContext("actor_train", args, cfg.model, cfg.algo, tok, torch.device("cpu"), seed=3,
                                         mesh=mesh, trainable=False))
                for args in (FSDPArgs(max_tokens_per_micro_batch=24), FSDPArgs()))
want_lp = padded.logprobs(mine)
tol = 8 * n_tokens * torch.finfo(torch.float32).eps * max(float(x.abs().max()) for x in want_lp)
for a, b in zip(lean.logprobs(mine), want_lp, strict=True):
    assert a.shape == b.shape and float((a - b).abs().max()) <= tol, (a, b, tol)
print(f"rank {comm.rank}: loss split ok", flush=True)
end_script(comm)
