"""The default experiment as a plain dict, and copies of it with fields set: the input of the
validation tests (``check(cfg)`` takes a plain mapping as well as a composed config)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from rlbatch.config.schema import RLBatchConfig


def default_config(run_dir: Path) -> dict[str, Any]:
    """The default experiment, its run directory at ``run_dir``."""
    return dataclasses.asdict(RLBatchConfig()) | {"run_dir": str(run_dir)}


def set_(cfg: dict[str, Any], **dotted: Any) -> dict[str, Any]:
    """A copy with 'a__b=value' set as cfg['a']['b'] (None deletes nothing: it sets None)."""
    out = copy.deepcopy(cfg)
    for key, value in dotted.items():
        *path, last = key.split("__")
        node = out
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return out
