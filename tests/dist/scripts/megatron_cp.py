"""Under mpiexec -n 4, the megatron engine's context parallelism (Ulysses over the cp axis) on real
megatron-core (CPU, gloo, the test-only shim), against the same engine on four data-parallel ranks
(d4). Every rank gets the same samples, so every layout computes the same thing:

- d2c2, t2c2 (sequence parallel inside each cp slice) and c4: log-probs over padded rows of odd
  and even lengths equal d4's (fp32 rounding), and each rank's model runs on its slice of the row
  only; three updates give d4's losses and gradient norms, and the weights after them agree;
- d2c2 resumes bit for bit (3 + 3 == 6) and its checkpoint loads into d4 (the same tensors);
- a critic and a reward model at c2 (d2c2): values and scores equal d4's.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import critic_directory, policy_steps, restore, resumes_exactly, same, trains_like, weights
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
NAMES = ("pp", "dp", "cp", "tp")
MESHES = {name: DeviceMesh("cpu", torch.arange(4).reshape(shape), mesh_dim_names=NAMES)
          for name, shape in (("d4", (1, 4, 1, 1)), ("d2c2", (1, 2, 2, 1)), ("t2c2", (1, 1, 2, 2)),
                              ("c4", (1, 1, 4, 1)))}
cfg = compose(["algo.lr=1e-2", "algo.warmup_steps=2", "algo.grad_clip=0.5", "algo.grad_accum=2"])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)
TMP = Path(comm.bcast(tempfile.mkdtemp(prefix="mcore-cp-") if comm.rank == 0 else None, root=0))
TOL, WEIGHT_TOL, LOGP_TOL = 1e-4, 1e-3, 1e-5
"""Stats relative, log-probs absolute: float32 rounding ~1e-6 apart (attention's sums run in another
order); a rank attending to its own slice only, or rotary positions restarting on each slice, is off
by ~0.1. Weights: AdamW divides by sqrt(v), so rounding grows over the updates (~1e-5)."""


def engine(mesh, head="lm", model=None, trainable=True):
    role = {"lm": "actor_train", "value": "critic", "reward": "reward"}[head]
    return MegatronEngine(EngineContext(role, MegatronArgs(micro_batch=3), model or cfg.model, cfg.algo, tok,
                                        torch.device("cpu"), seed=3, mesh=MESHES[mesh], trainable=trainable, head=head))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for k in range(8):
        n = 1 + k % 5
        out.append({"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g), "response": torch.randint(4, 18, (n,), generator=g),
                    "advantage": torch.tensor(float(k % 5) - 2.0), "returns": torch.randn(n, generator=g),
                    "values": torch.zeros(n)})
    return out


def gap(xs, ys):
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys, strict=True))


def train(e, steps):
    return policy_steps(e, steps, batch, objective)


def slice_lengths(e):
    """The sequence lengths the model's embedding sees on this rank during a log-prob pass."""
    seen = []
    handle = e.model.embedding.register_forward_hook(lambda m, args, kwargs, out: seen.append(out.shape[0]),
                                                     with_kwargs=True)
    full = e.logprobs(batch(9))
    handle.remove()
    return full, seen


d4 = engine("d4")
want_logp = d4.logprobs(batch(9))
ref_stats = train(d4, range(3))
ref = weights(d4)
for name in ("d2c2", "t2c2", "c4"):
    e = engine(name)
    got, seen = slice_lengths(e)
    err = gap(got, want_logp)
    assert err < LOGP_TOL, f"{name}: log-probs {err} from d4's"
    c = dict(zip(NAMES, MESHES[name].mesh.shape, strict=True))["cp"]
    t = dict(zip(NAMES, MESHES[name].mesh.shape, strict=True))["tp"]
    rows = [int(max(len(s["prompt"]) + len(s["response"]) for s in batch(9)[i : i + 3])) for i in range(0, 8, 3)]
    split = c * t  # each cp slice splits again over tp (sequence parallelism)
    assert seen == [-(-n // split) * split // c // t for n in rows], f"{name}: embedding saw {seen} for rows {rows}"
    stats, werr = trains_like(name, e, train, ref_stats, ref, TOL, WEIGHT_TOL)
    print(f"rank {comm.rank}: {name} log-probs within {err:.1e}, slices {seen} of rows {rows}, grad norms "
          f"{[round(s['grad_norm'], 5) for s in stats]}, weights within {werr:.1e} of d4's", flush=True)

six = engine("d2c2")
train(six, range(6))
resumed = resumes_exactly(lambda: engine("d2c2"), train, TMP / "cp3", weights(six), "d2c2: resume 3+3 vs 6")
into = engine("d4")
restore(into, TMP / "cp3")
half = engine("d2c2")
restore(half, TMP / "cp3")
same(into.checkpoint_state().tensors, half.checkpoint_state().tensors, "d2c2 checkpoint into d4")

critic = critic_directory(cfg, tok, 3, TMP / "critic")
err = gap(engine("d2c2", "value", critic).values(batch(9)), engine("d4", "value", critic).values(batch(9)))
assert err < LOGP_TOL, f"critic d2c2: values {err} from d4's"
rm = engine("d2c2", "reward", critic, trainable=False).scores(batch(9))
want = engine("d4", "reward", critic, trainable=False).scores(batch(9))
assert max(abs(a - b) for a, b in zip(rm, want, strict=True)) < LOGP_TOL, (rm, want)
print(f"rank {comm.rank}: critic values within {err:.1e}, reward scores equal d4's", flush=True)

dist.barrier()
if comm.rank == 0:
    shutil.rmtree(TMP, ignore_errors=True)
print(f"rank {comm.rank}: megatron context parallelism ok", flush=True)
end_script(comm)
