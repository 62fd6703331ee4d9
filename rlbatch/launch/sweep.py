"""Hydra's own command line: ``-m`` sweeps, ``--help``, ``--cfg job``.

A sweep runs the task below once per point with Hydra's basic launcher, in this process. With
cluster=slurm each call submits one sbatch job and returns at once, so every point is submitted
concurrently and the submitter exits after submitting (unless wait=true).
"""

from __future__ import annotations

import sys
from typing import Any

from rlbatch.errors import ConfigError, report_config_error


def _task(cfg: Any) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from rlbatch.checks.validate import check
    from rlbatch.launch.run import launch

    hc = HydraConfig.get()
    with open_dict(cfg):
        if hc.mode is not None and hc.mode.name == "MULTIRUN":
            cfg.run_dir = hc.runtime.output_dir  # each sweep point gets its own run directory
    OmegaConf.resolve(cfg)
    try:
        placement = check(cfg)
    except ConfigError as e:
        sys.exit(report_config_error(e))
    code = launch(cfg, placement)
    if code:
        sys.exit(code)


def hydra_cli(argv: list[str]) -> int:
    import hydra

    from rlbatch.config.compose import CONF_DIR, CONFIG_NAME
    from rlbatch.config.register import register

    register()
    sys.argv = [sys.argv[0], *argv]
    hydra.main(config_path=str(CONF_DIR), config_name=CONFIG_NAME, version_base=None)(_task)()
    return 0
