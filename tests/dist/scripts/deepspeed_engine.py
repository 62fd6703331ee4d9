"""Under mpiexec -n 3, the role on ranks 1 and 2 only (global rank 0 is not in it): the deepspeed
engine with ZeRO-1, -2 and -3 computes the fsdp engine's log-probs, resumes exactly (3 updates,
checkpoint through the store, a new engine, 3 more == 6 updates, bit for bit), loads an fsdp
checkpoint and the fsdp engine loads its checkpoint (same weights and AdamW state, bit for bit),
and offload/reload gives back the same state.

    mpiexec -n 3 python tests/dist/scripts/deepspeed_engine.py <port> <dir> [stages, e.g. 123]
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import policy_steps
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.algos.objective import PolicyObjective
from rlbatch.checkpoint.dcp import load_state, save_state
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.deepspeed import DeepSpeedArgs
from rlbatch.engines.deepspeed.engine import DeepSpeedEngine
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.model import load_tokenizer

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
root = Path(sys.argv[2])
stages = [int(c) for c in (sys.argv[3] if len(sys.argv) > 3 else "123")]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
ROLE = [1, 2]
mesh = DeviceMesh("cpu", torch.tensor(ROLE).reshape(1, 2, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
cfg = compose(["algo.mini_batches=2", "algo.lr=1e-2", "algo.grad_clip=0.5", "algo.warmup_steps=2", "algo.grad_accum=2"])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)


def ctx(args, trainable=True):
    return EngineContext("actor_train", args, cfg.model, cfg.algo, tok, torch.device("cpu"), seed=3, mesh=mesh,
                         trainable=trainable)


def ds(stage, **kw):
    return DeepSpeedEngine(ctx(DeepSpeedArgs(zero_stage=stage, **kw)))


def fsdp():
    return FSDPEngine(ctx(FSDPArgs()))


def batch(step):
    g = torch.Generator().manual_seed(100 * step + comm.rank)
    return [{"prompt": torch.randint(4, 18, (4,), generator=g), "response": torch.randint(4, 18, (1 + k % 3,), generator=g),
             "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(16)]


def train(engine, steps):
    return policy_steps(engine, steps, batch, objective)


def weights(engine, dtype=None):
    with engine.export_weights() as w:
        return {n: t.detach().clone() for n, t in w.tensors(dtype)}


def full_state(engine):
    out = {}
    for k, v in engine.checkpoint_state().tensors.items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def save(engine, path):
    save_state(path, engine.checkpoint_state())


def load(engine, path):
    engine.load_checkpoint_state(load_state(path, engine.checkpoint_state()))


def same(a, b, what, exact=True):
    assert a.keys() == b.keys(), f"{what}: names differ: {sorted(a.keys() ^ b.keys())[:5]}"
    for n in a:
        ok = torch.equal(a[n], b[n]) if exact else torch.allclose(a[n], b[n], rtol=0, atol=1e-5)
        assert ok, f"{what}: {n} differs by {(a[n].float() - b[n].float()).abs().max():.3g}"


if comm.rank in ROLE:
    ref = fsdp()
    expected = ref.logprobs(batch(0))
    initial = weights(ref)
    for stage in stages:
        tag = f"ZeRO-{stage}"
        os.environ["LOCAL_RANK"] = "7"  # exported by something else: DeepSpeed would take device 7
        whole = ds(stage)
        assert os.environ["LOCAL_RANK"] == "0", f"{tag}: LOCAL_RANK {os.environ['LOCAL_RANK']}, not the rank's device"
        got = whole.logprobs(batch(0))
        # Same fp32 weights and the same forward: only summation order may differ.
        for a, b in zip(expected, got, strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-5), f"{tag}: log-probs differ from fsdp's by {(a - b).abs().max():.3g}"
        same(initial, weights(whole), f"{tag}: initial weights")
        same({n: t.to(torch.bfloat16) for n, t in initial.items()}, weights(whole, torch.bfloat16), f"{tag}: bf16 export")
        stats_whole = train(whole, range(6))
        moved = max((weights(whole)[n] - initial[n]).abs().max().item() for n in initial)
        assert moved > 1e-3 and any(s["grad_norm"] > 0.5 for s in stats_whole), f"{tag}: weights must move ({moved})"
        first = ds(stage)
        stats_first = train(first, range(3))
        path = root / f"zero{stage}"
        save(first, path)
        # Offload frees the state and gives it back bit for bit.
        before = full_state(first)
        moved_bytes = first.offload(["params", "optimizer"]).bytes
        assert moved_bytes > 0, f"{tag}: offload moved nothing"
        first.reload(["params", "optimizer"])
        same(before, full_state(first), f"{tag}: offload round trip")
        resumed = ds(stage)
        load(resumed, path)
        stats_second = train(resumed, range(3, 6))
        same(weights(whole), weights(resumed), f"{tag}: 3 + 3 updates vs 6")
        same(full_state(whole), full_state(resumed), f"{tag}: state after 3 + 3 updates vs 6")
        assert stats_first + stats_second == stats_whole, f"{tag}: stats differ"
        # The deepspeed checkpoint into fsdp, the fsdp checkpoint into deepspeed.
        into_fsdp = fsdp()
        load(into_fsdp, path)
        same(full_state(first), full_state(into_fsdp), f"{tag} -> fsdp: weights and AdamW state")
        trained_fsdp = fsdp()
        train(trained_fsdp, range(3))
        fpath = root / f"fsdp{stage}"
        save(trained_fsdp, fpath)
        into_ds = ds(stage)
        load(into_ds, fpath)
        same(full_state(trained_fsdp), full_state(into_ds), f"fsdp -> {tag}: weights and AdamW state")
        train(trained_fsdp, range(3, 4))
        train(into_ds, range(3, 4))
        same(weights(trained_fsdp), weights(into_ds), f"fsdp -> {tag}: an update after the load", exact=False)
        print(f"rank {comm.rank}: {tag} ok", flush=True)
done = comm.Ibarrier()  # rank 0 waits for the role's ranks without spinning on a core they need
while not done.Test():
    time.sleep(0.2)
end_script(comm)
