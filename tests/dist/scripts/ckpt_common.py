"""Shared by the ckpt_*.py scripts: a tiny FSDP2 policy trained the way the fsdp engine trains it.

The model is the random-init Qwen2 of ``rlbatch.engines.model.load_model`` (char tokenizer,
vocabulary 18), sharded per layer and at the root over a "dp" DeviceMesh, with AdamW, a warm-up
LambdaLR and gradient clipping. Batches are drawn from the python, numpy and torch global RNGs,
so a resume that did not restore all three would diverge.
"""

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from rlbatch.config.schema import ModelConfig
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.engines.train_state import load_module_state, module_state

comm = MPI.COMM_WORLD
CONFIG = {"seed": 3, "model": OmegaConf.structured(ModelConfig(hidden_size=32, intermediate_size=64, max_position_embeddings=32))}


def init() -> DeviceMesh:
    port = comm.bcast(int(sys.argv[1]), root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    return DeviceMesh("cpu", torch.arange(comm.size), mesh_dim_names=("dp",))


def write_config(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(CONFIG), run_dir / "config.yaml")
    return run_dir / "config.yaml"


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(mesh: DeviceMesh, cfg=None, seed: int | None = None) -> SimpleNamespace:
    """An engine-like namespace: model, optimizer and scheduler, and the engine contract's
    checkpoint_state / load_checkpoint_state (as the fsdp engine gives them)."""
    cfg = OmegaConf.create(CONFIG) if cfg is None else cfg
    model = load_model(cfg.model, load_tokenizer(cfg.model), int(cfg.seed if seed is None else seed))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    model = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    group = mesh.get_group("dp")
    return SimpleNamespace(model=model, optimizer=opt, scheduler=sched,
                           checkpoint_state=lambda: module_state(model, opt, sched, group, "fsdp"),
                           load_checkpoint_state=lambda state: load_module_state(model, opt, sched, state))


def train_step(e: SimpleNamespace) -> None:
    n = random.randint(3, 7)
    x = torch.randint(4, 18, (2, n))
    w = torch.from_numpy(np.random.rand(2, n - 1).astype(np.float32))
    e.optimizer.zero_grad(set_to_none=False)
    logp = e.model(input_ids=x).logits[:, :-1].log_softmax(-1).gather(-1, x[:, 1:, None]).squeeze(-1)
    (-(logp * w).mean()).backward()
    torch.nn.utils.clip_grad_norm_(e.model.parameters(), 1.0)
    e.optimizer.step()
    e.scheduler.step()


def full_state(e: SimpleNamespace) -> dict:
    """Unsharded model + optimizer state and the lr, flattened (collective; filled on rank 0 only)."""
    msd, osd = get_state_dict(e.model, e.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():  # clone: AdamW's step counters are updated in place
        flat |= {f"optim.{fqn}.{k}": v.clone() for k, v in st.items()}
    flat["lr"] = torch.tensor(e.scheduler.get_last_lr()[0], dtype=torch.float64)
    return flat


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a.keys() ^ b.keys())[:5])
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def probe() -> torch.Tensor:
    return torch.arange(4, 18).reshape(2, 7)
