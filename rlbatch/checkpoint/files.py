"""Names inside a checkpoint directory and its small files, in one place (writers and readers both use these).

    <run_dir>/checkpoints/step_000012/
        manifest.json            written last by CheckpointStore.commit: files, sizes, sha256, meta
        controller.json          the controller's state (step, data position, ...)
        config.yaml              copy of the run's config.yaml, so the checkpoint stands alone
        actor_train/             torch.distributed.checkpoint (DCP) of the engine's named tensors
            .metadata  __0_0.distcp  __1_0.distcp ...     one shard file per rank of the role
            engine_meta.pt       the engine's metadata: optimizer param groups, LR scheduler
        rng/rank<r>.pt           torch / CUDA / numpy / python RNG states of world rank r
    <run_dir>/checkpoints/step_000015.tmp-<nonce>/   a checkpoint being written (or abandoned)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TypedDict

CHECKPOINTS = "checkpoints"
"""Sub-directory of the run dir that holds the checkpoints."""
MANIFEST = "manifest.json"
CONTROLLER = "controller.json"
CONFIG = "config.yaml"
RNG = "rng"


class ControllerState(TypedDict, total=False):
    """controller.json: the controller's part of a checkpoint (``rlbatch.loop.checkpointing``)."""

    step: int
    data: dict[str, int]
    """The prompt stream's position (``PromptStream.state_dict``)."""
    data_fingerprint: str
    reason: str
    """Why it was saved (``save_every``, the end of the run, a stop)."""
    policy_version: int
    """The generations made ahead of training (``rlbatch.loop.ahead.GenerationQueue``): the policy
    version the inference engine held, and how many steps' generations were saved."""
    generations_ahead: int


def role_dir(ckpt: Path, role: str) -> Path:
    """The DCP directory of a trainable role (``actor_train``, ``critic``)."""
    return ckpt / role


def rng_dir(ckpt: Path) -> Path:
    return ckpt / RNG


def write_controller(ckpt: Path, state: ControllerState, config_file: Path | None = None) -> None:
    """Write the controller's JSON state and a copy of the run's config into a staging dir."""
    (ckpt / CONTROLLER).write_text(json.dumps(state, indent=1, sort_keys=True))
    if config_file is not None and config_file.is_file():
        shutil.copyfile(config_file, ckpt / CONFIG)


def read_controller(ckpt: Path) -> ControllerState:
    """What ``write_controller`` wrote (empty when the checkpoint has none)."""
    path = ckpt / CONTROLLER
    state: ControllerState = json.loads(path.read_text()) if path.is_file() else {}
    return state


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
