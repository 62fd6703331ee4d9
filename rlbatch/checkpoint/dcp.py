"""A trainable role's state, as the engine gives it: named tensors saved with
torch.distributed.checkpoint (DCP), plus small metadata.

The format is engine-neutral: ``model.<hf_name>`` for the weights and ``optim.<hf_name>.<key>``
for optimizer state, whatever engine wrote them. Each rank of the role writes its own shards
(``__<rank>_0.distcp``); the group's first rank writes DCP's ``.metadata`` and the engine's
metadata (``engine_meta.pt``: optimizer param groups, LR scheduler). DCP records global shapes
and offsets, so a checkpoint written by one data-parallel layout loads into another
(resharding), and into a plain model without any process group (export). Forward-only roles
(reference) are not saved: they are rebuilt from ``model.path`` / the seed.

RNG states are per process: ``rng/rank<r>.pt`` holds torch (CPU and CUDA), numpy and python
``random`` states, so a resumed rank draws the same numbers as one that never stopped.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NotRequired, TypedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rlbatch.engines.base import CheckpointState

log = logging.getLogger(__name__)


class NumpyRngState(TypedDict):
    """numpy's legacy global RNG state, its key as a tensor (``np.random.get_state(legacy=True)``)."""

    kind: str
    key: torch.Tensor
    pos: int
    has_gauss: int
    gauss: float


class RngState(TypedDict):
    """A process's global RNG states (``rng_state``)."""

    torch: torch.Tensor
    numpy: NumpyRngState
    python: tuple[object, ...]
    """``random.getstate()``."""
    cuda: NotRequired[list[torch.Tensor]]
    """One per visible CUDA device, where CUDA was initialised."""

META = "engine_meta.pt"
"""Per-role file beside the DCP shards: the engine's small metadata (written by the group's first rank)."""


def _save_small(path: Path, obj: object) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _check_resident(tensors: Mapping[str, object]) -> None:
    """Refuse to checkpoint offloaded state (freed storages would be read as garbage)."""
    for name, t in tensors.items():
        local = getattr(t, "_local_tensor", t)
        if isinstance(local, torch.Tensor) and local.numel() and local.untyped_storage().nbytes() == 0:
            raise RuntimeError(f"checkpoint of offloaded state ({name}): reload the role's params and optimizer "
                               f"(Residency phase) before saving or loading a checkpoint")


def save_state(path: Path, state: CheckpointState) -> dict[str, float]:
    """Write an engine's named tensors (DCP shards) and its metadata into ``path``. Collective over
    ``state.group``."""
    _check_resident(state.tensors)
    t0 = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(state.tensors, checkpoint_id=path, process_group=state.group)
    if dist.get_rank(state.group) == 0:
        _save_small(path / META, state.meta)
    seconds = time.perf_counter() - t0
    log.info("saved %d tensors to %s in %.2f s", len(state.tensors), path, seconds)
    return {"seconds": seconds}


def load_state(path: Path, template: CheckpointState) -> CheckpointState:
    """Read what save_state wrote into ``template``'s tensors (in this, possibly differently sharded,
    layout) and return them with the saved metadata. Collective over ``template.group``."""
    _check_resident(template.tensors)
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}: no DCP checkpoint here (.metadata missing)")
    dcp.load(template.tensors, checkpoint_id=path, process_group=template.group)
    meta = torch.load(path / META, weights_only=True)
    return CheckpointState(template.tensors, meta, template.group)


def rng_state() -> RngState:
    """This process's global RNG states, as tensors and plain values (``weights_only`` loadable)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(key, np.ndarray)
    state: RngState = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: RngState) -> None:
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
