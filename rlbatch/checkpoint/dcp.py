"""A trainable role's state, sharded with torch.distributed.checkpoint (DCP) and staged through CPU.

Each rank of the role writes its own FSDP2 shards of the model and the AdamW state
(``__<rank>_0.distcp``); the role's first rank writes DCP's ``.metadata`` and the LR scheduler.
DCP records global shapes and offsets, so a checkpoint written by one data-parallel layout
loads into another (resharding), and into a plain model without any process group (export).
Forward-only roles (reference) are not saved: they are rebuilt from ``model.path`` / the seed.

RNG states are per process: ``rng/rank<r>.pt`` holds torch (CPU and CUDA), numpy and python
``random`` states, so a resumed rank draws the same numbers as one that never stopped.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rlbatch.checkpoint.files import SCHEDULER

log = logging.getLogger(__name__)

OPTIONS = StateDictOptions(cpu_offload=True)
"""Always stage DCP through host memory: gathering a second copy on the device can OOM (ROLL)."""


def _save_small(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _check_resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse to checkpoint offloaded state (freed storages would be read as garbage)."""
    tensors = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()
                                           if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        if local.numel() and local.untyped_storage().nbytes() == 0:
            raise RuntimeError("checkpoint of offloaded state: reload the role's params and optimizer "
                               "(Residency phase) before saving or loading a checkpoint")


def save_train_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: Any | None, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Write model + optimizer shards (DCP) and the scheduler into ``path``. Collective over ``group``."""
    _check_resident(model, optimizer)
    t0 = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)
    if scheduler is not None and dist.get_rank(group) == 0:
        _save_small(path / SCHEDULER, scheduler.state_dict())
    seconds = time.perf_counter() - t0
    log.info("saved train state to %s in %.2f s", path, seconds)
    return {"seconds": seconds}


def load_train_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: Any | None, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Restore what save_train_state wrote, into this (possibly differently sharded) layout."""
    _check_resident(model, optimizer)
    t0 = time.perf_counter()
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}: no DCP checkpoint here (.metadata missing)")
    # A fresh optimizer has no state yet; get_state_dict initialises it (a zero-lr step) so
    # that DCP has tensors to load into.
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=True))
    seconds = time.perf_counter() - t0
    log.info("loaded train state from %s in %.2f s", path, seconds)
    return {"seconds": seconds}


def rng_state() -> dict[str, Any]:
    """This process's global RNG states, as tensors and plain values (``weights_only`` loadable)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(key, np.ndarray)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning("CUDA RNG saved for %d devices, %d visible now: not restored",
                        len(state["cuda"]), torch.cuda.device_count())


def save_rng(path: Path, rank: int) -> Path:
    """Write this process's RNG states to ``path/rank<rank>.pt``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out = path / f"rank{rank}.pt"
    _save_small(out, rng_state())
    return out


def load_rng(path: Path, rank: int) -> bool:
    """Restore ``path/rank<rank>.pt``; False (and a warning) when this rank has none (layout changed)."""
    f = Path(path) / f"rank{rank}.pt"
    if not f.is_file():
        log.warning("no RNG state for rank %d in %s: keeping this process's seeding", rank, path)
        return False
    set_rng_state(torch.load(f, weights_only=True))
    return True
