"""Dispatch a validated config: dry run, local mpiexec, or Slurm submission."""

from __future__ import annotations

from typing import Any

from rlbatch.launch.dry_run import placement_table
from rlbatch.placement import Placement


def launch(cfg: Any, placement: Placement) -> int:
    """Run ``cfg`` as placed; returns the process exit code."""
    if cfg.dry_run:
        print(placement_table(placement))
        return 0
    print(placement_table(placement))
    print(f"\ncluster={cfg.cluster.name}: starting ranks is not available yet in this build.")
    return 1
