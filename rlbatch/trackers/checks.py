"""The ``trackers`` section, validated before anything starts: known trackers and fields, each
tracker's own rules (its spec's ``problems``), and, for a runnable check, its package installed."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from typing import Any

from rlbatch.config.plain import dotted
from rlbatch.trackers.registry import TRACKERS


def settings_of(section: Mapping[str, Any], settings: type) -> dict[str, Any]:
    """A tracker's section with the schema's defaults for the fields it does not give."""
    return dataclasses.asdict(settings()) | dict(section)


def tracker_problems(cfg: Mapping[str, Any], runnable: bool = True) -> list[str]:
    node = dotted(cfg, "trackers")
    if node is None:
        return []
    if not isinstance(node, Mapping):
        return [f"trackers: expected a mapping of tracker sections ({sorted(TRACKERS)}), got {node!r}"[:300]]
    out = []
    if unknown := sorted(str(k) for k in node if k not in TRACKERS):
        out.append(f"trackers: unknown tracker(s) {unknown}; this build has {sorted(TRACKERS)}")
    for name, spec in TRACKERS.items():
        section = node.get(name)
        if section is None:
            continue
        if not isinstance(section, Mapping):
            out.append(f"trackers.{name}: expected a mapping of settings, got {section!r}"[:300])
            continue
        known = {f.name for f in dataclasses.fields(spec.settings)}
        if bad := sorted(str(k) for k in section if k not in known):
            out.append(f"trackers.{name}: unknown field(s) {bad}; known fields: {sorted(known)}")
            continue
        s = settings_of(section, spec.settings)
        out.extend(spec.problems(s))  # enabled's type: bounds.field_problems, with every bool of the schema
        if runnable and s["enabled"] is True and importlib.util.find_spec(spec.package) is None:
            out.append(f"trackers.{name}.enabled: the '{spec.package}' package is not installed here; {spec.install}")
    return out
