"""The trackers of a typed config, validated before anything starts: each tracker's own rules (its
spec's ``problems``) and, for a runnable check of an enabled one, its package installed and what
the run directory's filesystem allows. Unknown trackers and fields, wrong types and ``logger``'s
names are the parse's (``rlbatch.config.tracker_shapes``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rlbatch.config.schema import RLBatchConfig
from rlbatch.config.tracker_shapes import TENSORBOARD as TENSORBOARD
from rlbatch.trackers.registry import TRACKERS


def active(config: RLBatchConfig) -> list[str]:
    """The trackers a run logs to: those ``logger`` names and those ``trackers.<name>.enabled``."""
    return [name for name, spec in TRACKERS.items()
            if name in config.logger or spec.settings(config.trackers).enabled]


def tracker_problems(config: RLBatchConfig, runnable: bool = True) -> list[str]:
    out = []
    on = active(config)
    for name, spec in TRACKERS.items():
        s = spec.settings(config.trackers)
        own = spec.problems(s)
        out.extend(own)
        if not runnable or name not in on:
            continue
        if importlib.util.find_spec(spec.package) is None:
            field = f"trackers.{name}.enabled" if s.enabled else f"logger: {name}"
            out.append(f"{field}: the '{spec.package}' package is not installed here; {spec.install}")
        if not own:
            out.extend(spec.machine_problems(s, Path(config.run_dir)))
    return out
