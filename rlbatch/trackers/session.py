"""The trackers of one run, on the controller: ``Trackers``, fed each step's metrics row by
``rlbatch.loop.metrics.Metrics`` (the only process that logs).

One run is one tracker run. ``<run_dir>/trackers.json`` keeps, per tracker, the id of its run and
the last step it has: the first job creates the run, every later job of the run directory (a
requeue, a resume) reattaches to the same id. A tracker is given every row of ``metrics.jsonl``
after its last step, and only those: a job that resumes from a checkpoint older than what a
tracker already has (it crashed after logging) leaves those steps' first values in the tracker; a
tracker that missed steps (down, or enabled only now) gets them from the rows kept before the
checkpoint. A tracker that fails is warned about once, retried after 1, 2, 4 ... 64 steps, and
caught up when it answers; training never waits for it beyond the one call that failed.

    <run_dir>/trackers.json   {"wandb": {"id": "3kq8zx1m", "last_step": 41}, "mlflow": {...}}
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbatch.config.schema import RLBatchConfig
from rlbatch.trackers.base import Settings, ShowsSamples, Tracker, TrackerSpec, build
from rlbatch.trackers.checks import active
from rlbatch.trackers.registry import TRACKERS

log = logging.getLogger(__name__)
STATE = "trackers.json"
RETRY_MAX = 64
"""The most steps between two tries of a tracker that failed."""


def numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """A row's numeric values (the step itself is the tracker's step, not a value)."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


HIDDEN = "<hidden>"


def run_params(config: RLBatchConfig) -> dict[str, Any]:
    """The config as a run's parameters, without the values of ``cluster.env``: the variables every
    rank gets may hold credentials (a token), which must not reach a tracker's server."""
    out = dataclasses.asdict(config)
    out["cluster"]["env"] = {k: HIDDEN for k in config.cluster.env}
    return out


def placement_params(placement: Mapping[str, Any]) -> dict[str, Any]:
    """``placement.json`` as a run's parameters: the job's shape and each role's engine and GPUs."""
    from rlbatch.placement.io import placement_from_dict
    from rlbatch.placement.table import compress

    p = placement_from_dict(dict(placement))
    return {"num_gpus": p.num_gpus, "num_nodes": p.num_nodes, "gpus_per_node": p.gpus_per_node,
            "processes": p.world_size,
            "roles": {name: {"backend": str(r.backend) if r.backend else "cpu", "gpu_ranks": compress(r.gpu_ranks),
                             "workers": r.world_size, "nodes": compress(sorted(set(r.nodes))),
                             "colocated_with": ",".join(r.colocated_with) or "-"}
                      for name, r in p.roles.items()}}


@dataclass
class _Slot:
    spec: TrackerSpec[Any]
    settings: Settings
    tracker: Tracker | None = None
    failing_since: int | None = None
    """The step at which it first failed (None: answering)."""
    retry_at: int = 0
    backoff: int = 1


class Trackers:
    def __init__(self, run_dir: Path, config: RLBatchConfig, placement: Mapping[str, Any] | None,
                 history: Sequence[Mapping[str, Any]], start: int) -> None:
        """Start every tracker ``config`` enables (``active``) and give it the rows of ``history``
        (the rows kept before the checkpoint this job resumes from, step < ``start``) it lacks."""
        self.run_dir, self.path, self.start = run_dir, run_dir / STATE, start
        self.state: dict[str, dict[str, Any]] = self._read()
        on = active(config)
        self.slots = [_Slot(spec, spec.settings(config.trackers)) for name, spec in TRACKERS.items() if name in on]
        self.params = run_params(config) | ({"placement": placement_params(placement)} if placement else {})
        self.samples_failed: set[str] = set()
        """Trackers whose ``log_samples`` failed (warned about once)."""
        for slot in self.slots:
            self._catch_up(slot, history, start)

    def log(self, history: Sequence[Mapping[str, Any]]) -> None:
        """Give each tracker the rows of ``history`` after its last step (the newest row, unless it
        was failing)."""
        if self.slots and history:
            step = int(history[-1]["step"])
            for slot in self.slots:
                self._catch_up(slot, history, step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Give step ``step``'s shown samples to each tracker that shows them (``ShowsSamples``)
        and answers now, unless it already has the step (a resumed run's earlier job logged it).
        A failure is warned about once per tracker; samples.jsonl keeps every row."""
        for slot in self.slots:
            name, tracker = slot.spec.name, slot.tracker
            if (tracker is None or slot.failing_since is not None or not isinstance(tracker, ShowsSamples)
                    or step <= self._last(name)):
                continue
            try:
                tracker.log_samples(step, rows)
            except Exception as e:  # noqa: BLE001 - a tracker must never fail the run
                if name not in self.samples_failed:
                    self.samples_failed.add(name)
                    log.warning("trackers.%s: logging samples failed: %s; samples.jsonl has them", name, _one_line(e))

    def close(self, completed: bool) -> None:
        for slot in self.slots:
            name = slot.spec.name
            if slot.failing_since is not None:
                log.warning("trackers.%s: still failing since step %d: its rows from step %d on are in metrics.jsonl "
                            "only; the next job of this run logs them", name, slot.failing_since, self._last(name) + 1)
            if slot.tracker is None:
                continue
            try:
                slot.tracker.finish(completed)
            except Exception as e:  # noqa: BLE001 - a tracker must never fail the run
                log.warning("trackers.%s: closing its run failed: %s", name, _one_line(e))

    def _catch_up(self, slot: _Slot, history: Sequence[Mapping[str, Any]], step: int) -> None:
        name = slot.spec.name
        if slot.failing_since is not None and step < slot.retry_at:
            return
        try:
            if slot.tracker is None:
                self._start(slot)  # a new run (none recorded, or the recorded one is gone) has no step yet
            last, pending = self._last(name), []
            for row in reversed(history):
                if int(row["step"]) <= last:
                    break
                pending.append(row)
            for row in reversed(pending):
                assert slot.tracker is not None
                slot.tracker.log(int(row["step"]), numbers(row))
                self.state[name]["last_step"] = int(row["step"])
        except Exception as e:  # noqa: BLE001 - a tracker must never fail the run
            if slot.failing_since is None:
                slot.failing_since = step
                log.warning("trackers.%s: %s; training goes on, every row stays in metrics.jsonl, and %s is tried "
                            "again in %d step(s)", name, _one_line(e), name, slot.backoff)
            slot.retry_at, slot.backoff = step + slot.backoff, min(2 * slot.backoff, RETRY_MAX)
            return
        finally:
            self._write()
        if slot.failing_since is not None:
            log.warning("trackers.%s: answering again at step %d; the steps it missed since step %d were logged now",
                        name, step, slot.failing_since)
            slot.failing_since, slot.backoff = None, 1

    def _start(self, slot: _Slot) -> None:
        name = slot.spec.name
        rec = self.state.get(name) or {}
        tracker = build(slot.spec, slot.settings, self.run_dir)
        run_id = tracker.start(rec.get("id"), self.params)
        resumed = rec.get("id") == run_id
        self.state[name] = {"id": run_id, "last_step": int(rec.get("last_step", -1)) if resumed else -1}
        self._write()
        slot.tracker = tracker
        last = self.state[name]["last_step"]
        print(f"trackers.{name}: {'reattached to' if resumed else 'started'} run {run_id}"
              f"{f' (has steps through {last})' if resumed and last >= 0 else ''}: {tracker.where()}", flush=True)
        if last >= self.start:
            log.warning("trackers.%s: run %s already has steps %d..%d, logged before the checkpoint this job resumed "
                        "from; it keeps their first values (metrics.jsonl has this job's)", name, run_id, self.start,
                        last)

    def _last(self, name: str) -> int:
        return int((self.state.get(name) or {}).get("last_step", -1))

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("trackers: %s is unreadable (%s); every tracker starts a new run", self.path, _one_line(e))
            return {}
        return state if isinstance(state, dict) else {}

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(self.state, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("trackers: cannot record the trackers' runs in %s: %s", self.path, _one_line(e))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def open_trackers(run_dir: Path, history: Sequence[Mapping[str, Any]], start: int) -> Trackers | None:
    """The trackers of the run in ``run_dir`` (its config.yaml and placement.json, as the launcher
    wrote them for this job); None when none is enabled."""
    from rlbatch.config.load import load_config
    from rlbatch.runtime.rundir import CONFIG, PLACEMENT

    try:
        config = load_config(run_dir / CONFIG)
    except FileNotFoundError:
        return None
    if not active(config):
        return None
    placement = json.loads((run_dir / PLACEMENT).read_text()) if (run_dir / PLACEMENT).exists() else None
    return Trackers(run_dir, config, placement, history, start)
