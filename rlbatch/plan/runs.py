"""Read finished runs (config.yaml, placement.json, metrics.jsonl) and predict each of their steps.

A run directory as the launcher and the controller write it:

    <run_dir>/config.yaml      the resolved config
    <run_dir>/placement.json   Placement.to_dict()
    <run_dir>/metrics.jsonl    one JSON object per step: step, time/step, time/<phase> (max over
                               ranks), time/offload, time/reload, tokens/generated, tokens/total, ...

Each step is predicted with that step's measured token counts (response lengths are the
policy's doing, not the system's), so the comparison isolates the time model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbatch.config.hardware import Hardware
from rlbatch.config.parse import parse
from rlbatch.config.schema import RLBatchConfig
from rlbatch.errors import ConfigError
from rlbatch.models.shape import ModelShape, shape_from_config
from rlbatch.placement import Placement
from rlbatch.plan.coefficients import Coefficients
from rlbatch.plan.layout import Layout, from_placement
from rlbatch.plan.predict import Prediction, predict
from rlbatch.plan.workload import Workload, workload_from_config

PHASE_KEYS = ("generate", "score", "ref_logprobs", "values", "old_logprobs", "train", "sync", "offload", "reload")
"""Phases whose time/<phase> a run reports and the planner predicts (names from rlbatch.phases)."""
RESPONSE_MAX_KEYS = ("tokens/response_max", "response_len/max")
"""Optional metrics with the longest response of the step (the decode steps it took)."""


@dataclass
class Run:
    path: Path
    cfg: RLBatchConfig
    placement: Placement
    steps: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return self.path.name

    def measured_on_cpu(self) -> bool:
        """True when the config asked for CPU or every rank reported 0 device bytes (no GPU)."""
        if self.cfg.cluster.device == "cpu":
            return True
        peaks = [v for s in self.steps for k, v in s.items() if k.startswith("mem/") and k.endswith("/peak_allocated")]
        return bool(peaks) and not any(peaks)


def load_run(path: str | Path) -> Run:
    """Read one run directory; a missing or unreadable file is a ConfigError naming it."""
    import yaml

    from rlbatch.placement.io import load_placement

    p = Path(path)
    files = {n: p / n for n in ("config.yaml", "placement.json", "metrics.jsonl")}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise ConfigError(f"run {p}: missing {missing}; a run directory holds config.yaml, placement.json and metrics.jsonl")
    try:
        cfg = parse(yaml.safe_load(files["config.yaml"].read_text()) or {}).config  # the run checked it
        placement = load_placement(files["placement.json"])
        steps = [json.loads(line) for line in files["metrics.jsonl"].read_text().splitlines() if line.strip()]
    except (ValueError, KeyError, TypeError, yaml.YAMLError) as e:
        raise ConfigError(f"run {p}: cannot read it: {type(e).__name__}: {e}"[:300]) from None
    if not steps:
        raise ConfigError(f"run {p}: metrics.jsonl has no steps")
    return Run(p, cfg, placement, steps)


def _num(rec: Mapping[str, Any], key: str) -> float | None:
    v = rec.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@dataclass
class StepPrediction:
    run: str
    step: int
    measured: dict[str, float]
    """time/<phase> and time/step as recorded."""
    prediction: Prediction


class RunModel:
    """Everything about a run that does not change from step to step."""

    def __init__(self, run: Run, hw: Hardware) -> None:
        self.run, self.hw = run, hw
        self.layout: Layout = from_placement(run.placement, run.cfg.cluster.cpus_per_task)
        self.shape: ModelShape = shape_from_config(run.cfg.model)
        self.base: Workload = workload_from_config(run.cfg)
        self.dtype = run.cfg.model.dtype

    def steps(self, skip: int) -> list[tuple[int, dict[str, float], Workload]]:
        """(step, measured times, that step's workload) for every step after the first ``skip``."""
        out = []
        for i, rec in enumerate(self.run.steps):
            if i < skip or _num(rec, "time/step") is None:
                continue
            rmax = next((_num(rec, k) for k in RESPONSE_MAX_KEYS if _num(rec, k) is not None), None)
            w = self.base.with_measured(_num(rec, "tokens/generated"), _num(rec, "tokens/total"), rmax,
                                        _num(rec, "sampling/rounds"))
            measured = {k: float(v) for k, v in rec.items() if k.startswith("time/") and _num(rec, k) is not None}
            out.append((int(rec.get("step", i)), measured, w))
        return out

    def predict_steps(self, coef: Coefficients, skip: int) -> list[StepPrediction]:
        cache: dict[Workload, Prediction] = {}
        out = []
        for step, measured, w in self.steps(skip):
            if w not in cache:
                cache[w] = predict(self.layout, self.shape, w, self.hw, self.dtype, coef)
            out.append(StepPrediction(self.run.name, step, measured, cache[w]))
        return out
