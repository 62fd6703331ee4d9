"""The default experiment as a plain dict, and copies of it with fields set: the input of the
validation tests (``check(cfg)`` takes a plain mapping as well as a composed config)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.schema import RLBatchConfig
from rlbatch.errors import ConfigError


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


def problems(cfg: dict[str, Any], runnable: bool = True) -> list[str]:
    """The problems validation refuses ``cfg`` with (it must refuse it)."""
    with pytest.raises(ConfigError) as e:
        check(cfg, runnable=runnable)
    return list(e.value.problems)
