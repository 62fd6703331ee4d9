"""The run directory: its layout, shared by the launcher (writes) and the ranks (read), and the
launcher's ``prepare_run_dir``, which writes what every rank reads first.

    <run_dir>/config.yaml        the resolved config the run was started with
    <run_dir>/placement.json     the Placement, computed once by the launcher
    <run_dir>/logs/rank<r>.log   each rank's output
    <run_dir>/logs/rank<r>.status  JSON: running / exited / failed / terminated, pid, host, roles
    <run_dir>/logs/missing_run_dir.json  JSON {node: host}: nodes the post-mortem found without
                                 the run directory (their ranks could not start)
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlbatch.placement import Placement

CONFIG = "config.yaml"
PLACEMENT = "placement.json"
LOGS = "logs"


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def placement(self) -> Path:
        return self.path / PLACEMENT

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_status(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.status"

    @property
    def missing_on(self) -> Path:
        return self.logs / "missing_run_dir.json"

    def read_missing_on(self) -> dict[int, str]:
        """Node index -> host of the nodes found without this run directory (empty if none)."""
        try:
            return {int(n): str(h) for n, h in json.loads(self.missing_on.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def write_status(self, rank: int, state: str, **extra: Any) -> None:
        """Record a rank's state; written atomically so a reader never sees half a file."""
        rec = {"rank": rank, "state": state, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()} | extra
        tmp = self.rank_status(rank).with_suffix(".status.tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, self.rank_status(rank))

    def read_status(self, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.rank_status(rank).read_text())
        except (OSError, ValueError):
            return None


def prepare_run_dir(cfg: Any, placement: Placement) -> RunDir:
    """Make run_dir absolute, create it, write config.yaml and placement.json (launcher side)."""
    from omegaconf import OmegaConf, open_dict

    from rlbatch.placement.io import save_placement

    path = Path(str(cfg.run_dir)).expanduser().resolve()
    with open_dict(cfg):
        cfg.run_dir = str(path)
    run = RunDir(path)
    run.logs.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run.config, resolve=True)
    save_placement(placement, run.placement)
    return run
