"""MLflow: ``trackers.mlflow.enabled=true`` (``MlflowConfig`` in rlbatch/config/schema.py).

Through ``MlflowClient`` (no global active run): the run is created once in ``trackers.mlflow.experiment``
and reattached by its id on every later job (status back to RUNNING). The config and the placement
are the run's parameters (dotted keys, as MLflow keeps them: immutable, so a resumed job adds only
the keys the run lacks and warns about changed values); each step's row is one ``log_batch``.
mlflow-skinny has no SQL store: the tracking URI is a file store or a server.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlbatch.config.schema import MlflowConfig
from rlbatch.config.tracker_shapes import nonempty_words, uri_words

log = logging.getLogger(__name__)

SERVER_SCHEMES = ("http", "https")
INVALID_KEY = re.compile(r"[^/\w.\- :]")
"""Characters MLflow refuses in a metric or parameter name."""
BATCH = 100
"""MLflow's most parameters (and tags) per log_batch call."""
VALUE_MAX = 6000
"""MLflow's longest parameter value."""
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
"""A step waits on a server that is down for about a minute, not MLflow's default of many minutes
(7 retries, backoff to 2 minutes); set the variables to override."""


def store_path(uri: str | None, run_dir: Path) -> Path | None:
    """The file store's directory for a tracking URI (None: a server)."""
    if uri is None:
        return run_dir / "mlruns"
    parts = urlsplit(uri)
    if parts.scheme in SERVER_SCHEMES:
        return None
    path = Path(parts.netloc + parts.path) if parts.scheme == "file" else Path(uri)
    return path if path.is_absolute() else run_dir / path


def problems(s: MlflowConfig) -> list[str]:
    """What MLflow's skinny client would refuse of settings of the right types."""
    out = []
    uri = s.tracking_uri
    if uri is not None:
        parts = urlsplit(uri)
        if not uri.strip():
            out.append(uri_words(uri))
        elif parts.scheme in SERVER_SCHEMES and not parts.netloc:
            out.append(f"trackers.mlflow.tracking_uri: {uri!r} names no host; expected 'http(s)://host:port'")
        elif parts.scheme not in ("", "file", *SERVER_SCHEMES):
            out.append(f"trackers.mlflow.tracking_uri: scheme {parts.scheme!r} of {uri!r} is not supported by the MLflow "
                       f"client rlbatch installs (mlflow-skinny: file stores and servers); use a path, a 'file:' URI "
                       f"or an 'http(s)://' server (a server may keep its runs in any database)")
    out.extend(nonempty_words(f"trackers.mlflow.{key}", v) for key, v in (("experiment", s.experiment),
                                                                          ("run_name", s.run_name))
               if v is not None and not v.strip())
    return out


def store_problems(s: MlflowConfig, run_dir: Path) -> list[str]:
    """A file store that cannot be created: its path, or a directory above it, is a file."""
    store = store_path(s.tracking_uri, run_dir)
    if store is None:
        return []
    for path in (store, *store.parents):
        try:
            if not path.exists():
                continue
            if path.is_dir():
                return []
        except OSError:  # not ours to read (permissions): the run's own start says why
            return []
        where = "is a file" if path == store else f"lies under {path}, a file"
        given = repr(s.tracking_uri) if s.tracking_uri is not None else f"unset ({store})"
        return [f"trackers.mlflow.tracking_uri: {given}: the file store {store} {where}, not a directory"]
    return []


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys; lists and scalars as JSON text (MLflow's values are text)."""
    out: dict[str, str] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out |= flat_params(v, f"{key}.")
        else:
            text = v if isinstance(v, str) else json.dumps(v, default=str)
            out[INVALID_KEY.sub("_", key)] = text[:VALUE_MAX]
    return out


def metric_key(key: str) -> str:
    """A metrics-row key as MLflow accepts it: 'eval/all/pass@4' -> 'eval/all/pass_at_4'."""
    return INVALID_KEY.sub("_", key.replace("@", "_at_"))


class MlflowTracker:
    def __init__(self, settings: MlflowConfig, run_dir: Path) -> None:
        self.s, self.run_dir = settings, run_dir
        self.uri = settings.tracking_uri
        self.store = store_path(self.uri, run_dir)
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, run_id: str | None, params: Mapping[str, Any]) -> str:
        for var, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(var, value)
        if self.store is not None:
            # MLflow 3 refuses file stores unless asked (it steers new users to a SQL store, which
            # the skinny client lacks); a file store is what a shared cluster filesystem holds well.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.store.mkdir(parents=True, exist_ok=True)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.store.as_uri() if self.store is not None else str(self.uri))
        flat = flat_params(params)
        if run_id is not None and self._reattach(run_id, flat):
            self.run_id = run_id
            return run_id
        name = self.s.experiment
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        run = self.client.create_run(exp_id, run_name=self.s.run_name or self.run_dir.name,
                                     tags={"rlbatch.run_dir": str(self.run_dir)})
        self.run_id = run.info.run_id
        self._params(flat)
        return self.run_id

    def _reattach(self, run_id: str, flat: dict[str, str]) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as e:  # another store than the earlier job's: a new run, said so
            log.warning("trackers.mlflow: run %s is not in %s (%s); starting a new MLflow run", run_id,
                        self.store or self.uri, str(e).splitlines()[0][:200])
            return False
        self.client.update_run(run_id, status="RUNNING")
        have = run.data.params
        changed = sorted(k for k, v in flat.items() if k in have and have[k] != v)
        if changed:
            log.warning("trackers.mlflow: the resumed run's config differs in %d parameter(s) from what run %s "
                        "recorded (MLflow keeps the first values): %s", len(changed), run_id, ", ".join(changed[:10]))
        self.run_id = run_id
        self._params({k: v for k, v in flat.items() if k not in have})
        return True

    def _params(self, flat: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + BATCH])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(metric_key(k), float(v), ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's most metrics per log_batch call
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """The step's shown samples as the artifact samples/step_<step>.jsonl."""
        self.client.log_text(self.run_id, "".join(json.dumps(dict(r)) + "\n" for r in rows),
                             f"samples/step_{step:06d}.jsonl")

    def where(self) -> str:
        return f"experiment {self.s.experiment!r} in {self.store.as_uri() if self.store is not None else self.uri}"

    def finish(self, completed: bool) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED" if completed else "KILLED")
