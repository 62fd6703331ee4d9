"""Turn any accepted config object into plain dicts and lists."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def dotted(node: Any, path: str, missing: Any = None) -> Any:
    """``node['a']['b']`` for ``path`` 'a.b' in nested mappings; ``missing`` where a key is absent or
    a step is not a mapping."""
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return missing
        node = node[key]
    return node


def to_plain(cfg: Any) -> Any:
    """A config as plain dicts/lists: accepts dataclasses, OmegaConf nodes and mappings."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf  # only when handed an OmegaConf node

        return OmegaConf.to_container(cfg, resolve=True)
    return cfg
