"""The launcher's side of the run directory: ``prepare_run_dir`` writes what every rank reads first.
Its layout and its lock: ``rlbatch.runtime.rundir``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlbatch.checkpoint.space import check_room_at_start
from rlbatch.placement import Placement
from rlbatch.placement.io import save_placement
from rlbatch.runtime.env import read_env
from rlbatch.runtime.rundir import RunDir, lock_run_dir


def prepare_run_dir(cfg: Any, placement: Placement) -> RunDir:
    """Make run_dir absolute, create it, take its lock, check that it has room for a checkpoint,
    write config.yaml and placement.json (launcher side).

    Raises ConfigError (nothing written) when another run holds the directory (``RunDirBusy``,
    naming the holder) or its filesystem cannot hold one checkpoint. The lock is this process's
    until it exits, or until ``RunDirLock.hand_over`` passes it to a Slurm job."""
    from omegaconf import OmegaConf, open_dict

    path = Path(str(cfg.run_dir)).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    lock = lock_run_dir(path, read_env().job_id)  # inside an allocation: that Slurm job's id
    check_room_at_start(cfg, placement, path)
    with open_dict(cfg):
        cfg.run_dir = str(path)
    run = RunDir(path, lock)
    run.logs.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run.config, resolve=True)
    save_placement(placement, run.placement)
    return run
