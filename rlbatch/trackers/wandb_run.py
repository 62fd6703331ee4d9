"""Weights & Biases: ``trackers.wandb.enabled=true`` (``WandbConfig`` in rlbatch/config/schema.py).

Offline (the default) the run is written under ``<run_dir>/wandb/offline-run-<time>-<id>``, one
directory per job of the run, all with the run's id; ``wandb sync --id <id> <run_dir>/wandb/offline-run-*``
uploads them, in start order, into one W&B run. Steps are W&B's own ``step`` (the RL step), so a
later job's rows follow the earlier ones'.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from rlbatch.config.schema import WandbConfig
from rlbatch.config.tracker_shapes import nonempty_words

TAG_MAX = 64
NAME_FORBIDDEN = re.compile(r"[/\\#?%:]")
"""Characters W&B refuses in a project or entity name."""


def problems(s: WandbConfig) -> list[str]:
    """What W&B would refuse of settings of the right types (``mode`` is one of the schema's choices)."""
    out = []
    for key, v in (("project", s.project), ("entity", s.entity), ("name", s.name)):
        if v is None:
            continue
        if not v.strip():
            out.append(nonempty_words(f"trackers.wandb.{key}", v))
        elif key != "name" and (bad := NAME_FORBIDDEN.search(v)):
            out.append(f"trackers.wandb.{key}: {v!r} holds {bad.group()!r}; W&B names may not contain / \\ # ? % :")
        elif len(v) > 128:
            out.append(f"trackers.wandb.{key}: {len(v)} characters, W&B takes at most 128")
    out.extend(f"trackers.wandb.tags[{i}]: expected a string of 1 to {TAG_MAX} characters, got {t!r}"
               for i, t in enumerate(s.tags) if not isinstance(t, str) or not 1 <= len(t) <= TAG_MAX)
    return out


SAMPLE_COLUMNS = ("id", "prompt", "response", "answer", "reward", "advantage", "response_tokens", "source", "end",
                  "detail", "turns")
"""The columns of the samples table: the fields of a samples.jsonl row (``rlbatch.loop.samples``)."""


def _cell(v: object) -> object:
    """A table cell: numbers and text as they are, a trajectory's turns as one text."""
    if isinstance(v, list):
        return "\n".join(f"[{t.get('by', '')}] {t.get('text', '')}" if isinstance(t, dict) else str(t) for t in v)
    return v


def new_id() -> str:
    """A W&B run id (8 lowercase letters and digits, as W&B makes them)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbTracker:
    def __init__(self, settings: WandbConfig, run_dir: Path) -> None:
        self.s, self.run_dir = settings, run_dir
        self.run: Any = None

    def start(self, run_id: str | None, params: Mapping[str, Any]) -> str:
        import wandb

        run_id = run_id or new_id()
        s = self.s
        mode: Literal["offline", "online"] = "online" if s.mode == "online" else "offline"
        self.run = wandb.init(
            id=run_id, resume="allow", dir=str(self.run_dir), mode=mode, project=s.project,
            entity=s.entity, name=s.name or self.run_dir.name, tags=list(s.tags),
            config=dict(params),
            # The controller's stdout is the run's log: W&B must not capture it. Its system monitor
            # would sample the controller's node alone; rlbatch's mem/ and host/ metrics cover every rank.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        return run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """The step's shown samples as the ``samples`` table (W&B keeps one per step)."""
        import wandb

        cols: list[str | int] = [c for c in SAMPLE_COLUMNS if any(c in r for r in rows)]
        table = wandb.Table(columns=cols, data=[[_cell(r.get(str(c), "")) for c in cols] for r in rows])
        self.run.log({"samples": table}, step=step)

    def finish(self, completed: bool) -> None:
        if self.run is None:
            return
        if not completed:  # a later job resumes this run: W&B shows it as preempted, not crashed
            self.run.mark_preempting()
        self.run.finish(exit_code=0)
        self.run = None

    def where(self) -> str:
        if self.run is None:
            return ""
        if self.s.mode == "offline":
            return f"offline in {self.run_dir / 'wandb'} (upload: wandb sync --id {self.run.id} {self.run_dir / 'wandb'}/offline-run-*)"
        return str(self.run.url or "")
