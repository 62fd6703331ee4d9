"""Under mpiexec -n 2, the deepspeed engine training rank-4 adapters (``model.lora``) with ZeRO-1, -2
and -3 on both ranks: it starts as the base model (the fsdp engine's log-probs and merged weights);
an update changes adapters only (every base weight bitwise); ``base_logprobs`` stays the base
model's; the sync is the merge of its parameters under the base names (or, adapter-only, the
adapters under PEFT's saved names); the checkpoint holds the
adapters and their AdamW state only, resumes exactly (2 + 2 updates == 4, bit for bit) and loads
into the fsdp engine with adapters (same adapters and AdamW state, bit for bit); offload and reload
give every parameter and the adapters' state back bit for bit.

    mpiexec -n 2 python tests/dist/scripts/deepspeed_lora.py <port> <dir> [stages, e.g. 123]
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import checkpoint, policy_steps, restore, same, weights
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.deepspeed import DeepSpeedArgs
from rlbatch.engines.deepspeed.engine import DeepSpeedEngine
from rlbatch.engines.deepspeed.world import role_world
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.model import load_tokenizer
from rlbatch.models import lora

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
root = Path(sys.argv[2])
stages = [int(c) for c in (sys.argv[3] if len(sys.argv) > 3 else "123")]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
mesh = DeviceMesh("cpu", torch.tensor([0, 1]).reshape(1, 2, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
# lr 1e-2: the adapters move far enough in 2 updates that B A changes the log-probs visibly.
cfg = compose(["algo.lr=1e-2", "algo.grad_clip=0.5", "algo.warmup_steps=1", "model.lora.rank=4",
               "model.lora.alpha=8"])
plain = compose(["algo.lr=1e-2"])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)


def ctx(c, args):
    return EngineContext("actor_train", args, c.model, c.algo, tok, torch.device("cpu"), seed=3, mesh=mesh,
                         trainable=True)


def batch(step):
    g = torch.Generator().manual_seed(100 * step + comm.rank)
    return [{"prompt": torch.randint(4, 18, (4,), generator=g), "response": torch.randint(4, 18, (1 + k % 3,), generator=g),
             "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(8)]


def train(engine, steps):
    return policy_steps(engine, steps, batch, objective)


def params(e):
    """Every parameter of a deepspeed engine's module, whole (gathered under ZeRO-3), PEFT-named."""
    import deepspeed

    with role_world(e.group), deepspeed.zero.GatheredParameters(e.params, enabled=e.stage == 3):
        return {n: p.detach().clone() for n, p in zip(e.names, e.params, strict=True)}


def close(a, b, what):
    # The same fp32 weights and forward as fsdp's: only summation order may differ.
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=0, atol=1e-5), f"{what}: differ by {(x - y).abs().max():.3g}"


base = FSDPEngine(ctx(plain, FSDPArgs()))  # the model with no adapters: what the reference is
base_lp = base.logprobs(batch(9))
base_w = weights(base)
for stage in stages:
    tag = f"ZeRO-{stage}"
    whole = DeepSpeedEngine(ctx(cfg, DeepSpeedArgs(zero_stage=stage)))
    assert whole.lora is not None and whole.optimizer is not None
    trained = {n for n, p in zip(whole.names, whole.params, strict=True) if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained), f"{tag}: trained {sorted(trained)[:3]}"
    # ZeRO's fp32 master partitions (what AdamW steps), over both ranks: the adapters' elements and
    # ZeRO's alignment padding (a few per tensor), nowhere near the base's.
    masters = [*getattr(whole.engine.optimizer, "single_partition_of_fp32_groups", []),
               *getattr(whole.engine.optimizer, "fp32_partitioned_groups_flat", [])]
    held = torch.tensor(float(sum(t.numel() for t in masters)))
    dist.all_reduce(held)
    n_trained = sum(p.numel() for n, p in params(whole).items() if n in trained)
    n_base = sum(p.numel() for n, p in params(whole).items() if n not in trained)
    assert n_trained <= held.item() < n_trained + 64 * len(trained) < n_base, f"{tag}: {held.item()} master " \
        f"elements for {n_trained} adapter elements ({n_base} base)"
    close(whole.logprobs(batch(9)), base_lp, f"{tag}: the adapted model at step 0 vs the base model")
    same(weights(whole), base_w, f"{tag}: merged weights at step 0 (B = 0) vs the base model's")
    before = params(whole)
    stats_whole = train(whole, range(2))
    after = params(whole)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= trained and any(".lora_B." in n for n in changed), f"{tag}: changed {sorted(changed)[:4]}"
    adapted_lp = whole.logprobs(batch(9))
    assert max(float((x - y).abs().max()) for x, y in zip(adapted_lp, base_lp, strict=True)) > 1e-3, \
        f"{tag}: the adapters must change the policy for the checks below to mean anything"
    close(whole.base_logprobs(batch(9)), base_lp, f"{tag}: base_logprobs after training vs the base model")
    same(dict(enumerate(whole.logprobs(batch(9)))), dict(enumerate(adapted_lp)), f"{tag}: adapters back on")
    same(weights(whole), dict(lora.merged(after.items(), lora.scaling(cfg.model.lora))), f"{tag}: sync is the merge")
    with whole.export_adapters() as stream:
        alone = {n: t.clone() for n, t in stream.tensors(None)}
    same(alone, {a: t for n, t in after.items() if (a := lora.adapter_name(n)) is not None},
         f"{tag}: adapter-only sync is the adapters under PEFT's saved names")
    stats_whole += train(whole, range(2, 4))

    first = DeepSpeedEngine(ctx(cfg, DeepSpeedArgs(zero_stage=stage)))
    stats_first = train(first, range(2))
    state = first.checkpoint_state().tensors
    saved = {k[len("model."):] for k in state if k.startswith("model.")}
    assert saved == trained, f"{tag}: the checkpoint's weights {sorted(saved ^ trained)[:3]} (adapters only)"
    assert all(k.startswith("model.") or k.split(".", 1)[1].rsplit(".", 1)[0] in trained for k in state), \
        f"{tag}: optimizer state of a frozen weight"
    path = root / f"zero{stage}"
    checkpoint(first, path)
    # Offload frees the frozen base beside the adapters and gives both back bit for bit.
    held_before, state_before = params(first), first.checkpoint_state().tensors
    assert first.offload(["params", "optimizer"]).bytes > 0, f"{tag}: offload moved nothing"
    first.reload(["params", "optimizer"])
    same(params(first), held_before, f"{tag}: offload round trip of the parameters")
    same(first.checkpoint_state().tensors, state_before, f"{tag}: offload round trip of the adapters' state")
    resumed = DeepSpeedEngine(ctx(cfg, DeepSpeedArgs(zero_stage=stage)))
    restore(resumed, path)
    stats_second = train(resumed, range(2, 4))
    same(params(whole), params(resumed), f"{tag}: every parameter after 2 + 2 updates vs 4")
    same(whole.checkpoint_state().tensors, resumed.checkpoint_state().tensors, f"{tag}: state after 2 + 2 vs 4")
    assert stats_first + stats_second == stats_whole, f"{tag}: stats differ"
    into_fsdp = FSDPEngine(ctx(cfg, FSDPArgs()))
    restore(into_fsdp, path)
    fs = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in into_fsdp.checkpoint_state().tensors.items()}
    same(fs, state, f"{tag} -> fsdp with adapters: adapters and AdamW state")
    print(f"rank {comm.rank}: {tag} lora ok", flush=True)
end_script(comm)
