"""One rank's part of a checkpoint: the DCP shards of every trainable role it serves, and its RNG.

Called by the rank handlers with the checkpoint's staging (save) or final (load) directory.
Both are collective over each trainable role's dp group, so every rank of such a role must call
them; roles are visited in sorted order on every rank, so ranks serving several roles agree.
Forward-only engines (no optimizer: reference, inference) are skipped: they are rebuilt from
``model.path`` or the seed, and actor_infer receives actor_train's weights by the usual sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbatch.checkpoint.dcp import load_rng, load_train_state, save_rng, save_train_state
from rlbatch.checkpoint.files import rng_dir, role_dir
from rlbatch.checkpoint.store import CheckpointError


def _trainable(engines: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [(r, engines[r]) for r in sorted(engines) if getattr(engines[r], "optimizer", None) is not None]


def save_rank(ckpt: Path, engines: Mapping[str, Any], rank: int) -> dict[str, float]:
    """Write this rank's shards and RNG into the staging dir ``ckpt``; returns seconds per role."""
    out = {}
    for role, eng in _trainable(engines):
        out[role] = save_train_state(role_dir(ckpt, role), eng.model, eng.optimizer,
                                     getattr(eng, "scheduler", None), eng.dp_group)["seconds"]
    save_rng(rng_dir(ckpt), rank)
    return out


def load_rank(ckpt: Path, engines: Mapping[str, Any], rank: int) -> dict[str, float]:
    """Restore this rank's trainable roles and RNG from the committed checkpoint ``ckpt``."""
    out = {}
    for role, eng in _trainable(engines):
        if not (role_dir(ckpt, role) / ".metadata").is_file():
            raise CheckpointError(f"{ckpt}: no state for role {role} (was it trainable when this was saved?)")
        out[role] = load_train_state(role_dir(ckpt, role), eng.model, eng.optimizer,
                                     getattr(eng, "scheduler", None), eng.dp_group)["seconds"]
    load_rng(rng_dir(ckpt), rank)
    return out
