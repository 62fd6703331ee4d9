"""The ``logger`` and ``trackers`` sections' shapes, in the words ``rlbatch.config.parse`` refuses
them with: the names ``logger`` may list, the trackers this build has (``TrackersConfig``'s
sections), and each tracker field's type. What a tracker makes of a value of the right type (a W&B
name's characters, an MLflow URI's scheme, a blank string) is its own rules' (``rlbatch.trackers``),
which use the same words where they refuse the same thing."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from rlbatch.config.schema import TrackersConfig

TENSORBOARD = "tensorboard"
"""The ``logger`` entry of TensorBoard's event files (written by the metrics, not a tracker)."""
TRACKER_NAMES = tuple(f.name for f in dataclasses.fields(TrackersConfig))
"""The trackers this build has: one section each under ``trackers``."""
LOGGERS = [TENSORBOARD, *TRACKER_NAMES]
"""What ``logger`` may list."""

CHOICES = {"trackers.wandb.mode": ("offline", "online")}


def nonempty_words(path: str, v: object) -> str:
    return f"{path}: expected a non-empty string, got {v!r}"


def uri_words(v: object) -> str:
    return f"trackers.mlflow.tracking_uri: expected a path, a 'file:' URI or an 'http(s)://' server, got {v!r}"


def _logger_words(v: object) -> str:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        return f"logger: expected a list of names from {LOGGERS}, e.g. logger=[tensorboard,wandb], got {v!r}"[:300]
    return f"logger: unknown {[x for x in v if x not in LOGGERS]}; this build logs to {LOGGERS}"


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def _section_words(name: str) -> Callable[[object], str]:
    return lambda v: f"trackers.{name}: expected a mapping of settings, got {v!r}"[:300]


SHAPE_RULES: dict[str, tuple[Callable[[object], bool], Callable[[object], str]]] = {
    "logger": (lambda v: isinstance(v, (list, tuple)) and all(x in LOGGERS for x in v), _logger_words),
    "trackers.wandb.tags": (lambda v: isinstance(v, (list, tuple)),
                            lambda v: f"trackers.wandb.tags: expected a list of strings, got {v!r}"),
    "trackers.mlflow.tracking_uri": (_is_str, uri_words),
    **{path: (_is_str, functools.partial(nonempty_words, path)) for path in (
        "trackers.wandb.project", "trackers.wandb.entity", "trackers.wandb.name", "trackers.mlflow.experiment",
        "trackers.mlflow.run_name")},
}
"""Fields whose problem says what the value must be in words of its own."""

NOT_A_MAPPING: dict[str, Callable[[object], str]] = {
    "trackers": lambda v: f"trackers: expected a mapping of tracker sections ({sorted(TRACKER_NAMES)}), got {v!r}"[:300],
    **{f"trackers.{name}": _section_words(name) for name in TRACKER_NAMES},
}
"""Sections whose value, when it is not a mapping, is refused in words of their own."""

UNKNOWN_KEYS: dict[str, Callable[[list[str]], str]] = {
    "trackers": lambda unknown: f"trackers: unknown tracker(s) {unknown}; this build has {sorted(TRACKER_NAMES)}",
}
"""Sections whose unknown keys are refused in words of their own."""
