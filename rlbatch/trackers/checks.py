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


TENSORBOARD = "tensorboard"
"""The ``logger`` entry of TensorBoard's event files (written by the metrics, not a tracker)."""


def active(cfg: Mapping[str, Any]) -> list[str]:
    """The trackers a run logs to: those ``logger`` names and those ``trackers.<name>.enabled``."""
    listed = cfg.get("logger")
    listed = listed if isinstance(listed, (list, tuple)) else []
    section = cfg.get("trackers")
    section = section if isinstance(section, Mapping) else {}
    return [name for name in TRACKERS if name in listed
            or (isinstance(section.get(name), Mapping) and section[name].get("enabled") is True)]


def logger_problems(cfg: Mapping[str, Any]) -> list[str]:
    """``logger``: a list of names, each TensorBoard's or a tracker's."""
    listed = cfg.get("logger", [TENSORBOARD])
    known = [TENSORBOARD, *TRACKERS]
    if not isinstance(listed, (list, tuple)) or not all(isinstance(x, str) for x in listed):
        return [f"logger: expected a list of names from {known}, e.g. logger=[tensorboard,wandb], got {listed!r}"[:300]]
    if unknown := [x for x in listed if x not in known]:
        return [f"logger: unknown {unknown}; this build logs to {known}"]
    return []


def tracker_problems(cfg: Mapping[str, Any], runnable: bool = True) -> list[str]:
    out = logger_problems(cfg)
    on = active(cfg)
    node = dotted(cfg, "trackers")
    if node is None:
        node = {}
    if not isinstance(node, Mapping):
        return [*out, f"trackers: expected a mapping of tracker sections ({sorted(TRACKERS)}), got {node!r}"[:300]]
    if unknown := sorted(str(k) for k in node if k not in TRACKERS):
        out.append(f"trackers: unknown tracker(s) {unknown}; this build has {sorted(TRACKERS)}")
    for name, spec in TRACKERS.items():
        section = node.get(name)
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            out.append(f"trackers.{name}: expected a mapping of settings, got {section!r}"[:300])
            continue
        known = {f.name for f in dataclasses.fields(spec.settings)}
        if bad := sorted(str(k) for k in section if k not in known):
            out.append(f"trackers.{name}: unknown field(s) {bad}; known fields: {sorted(known)}")
            continue
        s = settings_of(section, spec.settings)
        out.extend(spec.problems(s))  # enabled's type: bounds.field_problems, with every bool of the schema
        if runnable and name in on and importlib.util.find_spec(spec.package) is None:
            field = f"trackers.{name}.enabled" if s["enabled"] is True else f"logger: {name}"
            out.append(f"{field}: the '{spec.package}' package is not installed here; {spec.install}")
    return out
