"""Turn any accepted config object into plain dicts and lists."""

from __future__ import annotations

import dataclasses
from typing import Any


def to_plain(cfg: Any) -> Any:
    """A config as plain dicts/lists: accepts dataclasses, OmegaConf nodes and mappings."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf  # only when handed an OmegaConf node

        return OmegaConf.to_container(cfg, resolve=True)
    return cfg
