"""The tracker contract and its registry: what ``rlbatch.trackers.session`` drives, and how a tracker
is found by the name of its section under ``trackers`` in the config.

A tracker is built on the controller only, from its section's typed settings (its schema dataclass
in ``TrackersConfig``, ``enabled`` among its fields) and the run directory. It creates its run the
first time and reattaches to it, by the id the session kept in the run directory, on every later
job of the same run. Nothing in the scheduler names a tracker: adding one is a module with a class
that implements ``Tracker``, a dataclass for its settings in ``TrackersConfig``, and a ``register``
line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from rlbatch.config.schema import TrackersConfig


class Tracker(Protocol):
    """One experiment tracker's run, driven by the controller."""

    def start(self, run_id: str | None, params: Mapping[str, Any]) -> str:
        """Create the tracker's run (``run_id`` None) or reattach to the run ``run_id`` with resume
        semantics; log ``params`` (the config and the placement, nested); return the run's id."""
        ...

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """One step's numbers; steps come in increasing order and never repeat a logged one."""
        ...

    def where(self) -> str:
        """Where the run can be found (a path, a URL, how to upload it), for the start-up line."""
        ...

    def finish(self, completed: bool) -> None:
        """Close the run: ``completed`` when the run reached its last step, else it stopped early
        (preemption, walltime) and a later job may reattach."""
        ...


@runtime_checkable
class ShowsSamples(Protocol):
    """A tracker that also shows sample completions (``rlbatch.loop.samples``) as a table."""

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Step ``step``'s shown samples, each a row of samples.jsonl; called before the step's
        numbers (``log``) and after the previous step's."""
        ...


class Settings(Protocol):
    """What every tracker's settings have."""

    enabled: bool


S = TypeVar("S", bound=Settings)


def no_problems(settings: object, run_dir: Path) -> list[str]:
    return []


@dataclass(frozen=True)
class TrackerSpec(Generic[S]):
    name: str
    """Its section under ``trackers`` in the config (``trackers.<name>.enabled``)."""
    target: str
    """'module:Class' of the implementation, imported on the controller when enabled; the class
    takes ``(settings: S, run_dir: Path)``."""
    settings: Callable[[TrackersConfig], S]
    """Its section of the typed config (``lambda t: t.wandb``)."""
    problems: Callable[[S], list[str]]
    """Its settings -> problems naming the field and the value (the parse refused the wrong types)."""
    package: str
    """The import name the implementation needs; an enabled tracker without it is refused."""
    install: str
    """What to install when ``package`` is missing."""
    machine_problems: Callable[[S, Path], list[str]] = no_problems
    """For a runnable check of an enabled tracker: what this machine and the run directory
    (``run_dir``) would refuse (a file store that cannot be created)."""


TRACKERS: dict[str, TrackerSpec[Any]] = {}
"""name -> spec; each spec's settings type is its own."""


def register(spec: TrackerSpec[Any]) -> None:
    if spec.name in TRACKERS:
        raise ValueError(f"tracker {spec.name!r} is registered twice")
    TRACKERS[spec.name] = spec


def build(spec: TrackerSpec[S], settings: S, run_dir: Path) -> Tracker:
    import importlib

    module, _, cls = spec.target.partition(":")
    tracker: Tracker = getattr(importlib.import_module(module), cls)(settings, run_dir)
    return tracker
