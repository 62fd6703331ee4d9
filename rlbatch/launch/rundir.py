"""Prepare a run directory: the resolved config and the Placement every rank will read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlbatch.placement import Placement
from rlbatch.placement.io import save_placement
from rlbatch.runtime.rundir import RunDir


def prepare_run_dir(cfg: Any, placement: Placement) -> RunDir:
    """Make run_dir absolute, create it, write config.yaml and placement.json."""
    from omegaconf import OmegaConf, open_dict

    path = Path(str(cfg.run_dir)).expanduser().resolve()
    with open_dict(cfg):
        cfg.run_dir = str(path)
    run = RunDir(path)
    run.logs.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run.config, resolve=True)
    save_placement(placement, run.placement)
    return run
