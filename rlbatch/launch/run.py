"""Dispatch a validated config: dry run, local mpiexec, or Slurm submission."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbatch.errors import ConfigError, report_config_error
from rlbatch.placement import Placement
from rlbatch.placement.table import placement_table


def launch(cfg: Any, placement: Placement) -> int:
    """Run ``cfg`` as placed; returns the process exit code."""
    print(placement_table(placement), flush=True)
    run_dir = Path(str(cfg.run_dir)).expanduser().resolve()
    if cfg.cluster.name == "slurm":
        if cfg.dry_run:
            from rlbatch.launch.slurm import sbatch_script

            print(f"\nsbatch script (run_dir {run_dir}):\n")
            print(sbatch_script(cfg, placement, run_dir))
            return 0
        from rlbatch.launch.slurm import submit

        return _refusable(submit, cfg, placement)
    from rlbatch.launch.local import mpiexec_command, run_local

    if cfg.dry_run:
        print("\ncommand: " + shlex.join(mpiexec_command(cfg, placement, run_dir)))
        return 0
    return _refusable(run_local, cfg, placement)


def _refusable(start: Callable[[Any, Placement], int], cfg: Any, placement: Placement) -> int:
    """``start(cfg, placement)``, or exit code 2 with the problems when it refuses before anything
    starts: the heavy checks (``rlbatch.checks.preflight``: a chat template that disagrees with its
    tokenizer), the run directory is another run's (its lock), or has no room for a checkpoint."""
    from rlbatch.checks.preflight import preflight

    try:
        preflight(cfg)
        return start(cfg, placement)
    except ConfigError as e:
        return report_config_error(e)
