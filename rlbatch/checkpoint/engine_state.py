"""One rank's part of a checkpoint: the state of every trainable engine it serves, and its RNG.

Called by the rank handlers with the checkpoint's staging (save) or final (load) directory.
Both are collective over each trainable role's group, so every rank of such a role must call
them; roles are visited in sorted order on every rank, so ranks serving several roles agree.
An engine's state comes from the engine contract (``checkpoint_state``: named tensors and
metadata), so this module knows no engine. Forward-only engines (reference, inference) have
none: they are rebuilt from ``model.path`` or the seed, and actor_infer receives actor_train's
weights by the usual sync.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, TypeGuard

from rlbatch.checkpoint.dcp import load_rng, load_state, save_rng, save_state
from rlbatch.checkpoint.files import rng_dir, role_dir
from rlbatch.checkpoint.space import disk_full_error, failure_summary, is_disk_full
from rlbatch.checkpoint.store import CheckpointError
from rlbatch.engines.base import CheckpointState
from rlbatch.runtime.faults import maybe_fault


class Checkpointed(Protocol):
    """An engine with checkpoint state (the ``TrainEngine`` contract's part of it)."""

    def checkpoint_state(self) -> CheckpointState | None: ...

    def load_checkpoint_state(self, state: CheckpointState) -> None: ...


def _checkpointed(engine: object) -> TypeGuard[Checkpointed]:
    """Whether ``engine`` has checkpoint state methods (forward-only engines have none)."""
    return getattr(engine, "checkpoint_state", None) is not None


def _with_state(engines: Mapping[str, object]) -> list[tuple[str, Checkpointed, CheckpointState]]:
    out = []
    for role in sorted(engines):
        engine = engines[role]
        if not _checkpointed(engine):
            continue
        state = engine.checkpoint_state()
        if state is not None:
            out.append((role, engine, state))
    return out


def save_rank(ckpt: Path, engines: Mapping[str, object], rank: int) -> dict[str, float]:
    """Write this rank's shards and RNG into the staging dir ``ckpt``; returns seconds per role.

    A write that fails raises an ``Exception`` (``DiskFull`` with the free space when the disk is
    full), never DCP's ``CheckpointException``, a BaseException that the command server would not
    answer the controller with (it would wait out its timeout)."""
    maybe_fault("checkpoint_write", rank)
    try:
        out = {role: save_state(role_dir(ckpt, role), state)["seconds"] for role, _, state in _with_state(engines)}
        save_rng(rng_dir(ckpt), rank)
    except (Exception, _checkpoint_exception()) as e:
        if is_disk_full(e, ckpt):
            raise disk_full_error(ckpt, e) from e
        if isinstance(e, Exception):
            raise
        raise RuntimeError(f"checkpoint write into {ckpt} failed: {failure_summary(e)}") from e
    return out


def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def load_rank(ckpt: Path, engines: Mapping[str, object], rank: int) -> dict[str, float]:
    """Restore this rank's trainable roles and RNG from the committed checkpoint ``ckpt``."""
    out = {}
    for role, engine, template in _with_state(engines):
        if not (role_dir(ckpt, role) / ".metadata").is_file():
            raise CheckpointError(f"{ckpt}: no state for role {role} (was it trainable when this was saved?)")
        t0 = time.perf_counter()
        try:
            state = load_state(role_dir(ckpt, role), template)
        except _checkpoint_exception() as e:  # a BaseException: see save_rank
            raise CheckpointError(f"{ckpt}: reading {role} failed: {failure_summary(e)}") from e
        engine.load_checkpoint_state(state)
        out[role] = time.perf_counter() - t0
    load_rng(rng_dir(ckpt), rank)
    return out
