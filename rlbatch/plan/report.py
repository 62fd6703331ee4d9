"""Predicted against measured: time per phase and per step, and the mean absolute percentage error.

    python -m rlbatch.plan report runs/a runs/b --profile plan-profile.yaml [--json]

MAPE over steps: mean of |predicted - measured| / measured, per phase and for the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlbatch.plan.render import secs, table
from rlbatch.plan.runs import PHASE_KEYS, StepPrediction


@dataclass
class RunReport:
    run: str
    steps: int
    measured: dict[str, float] = field(default_factory=dict)
    """Mean seconds per key (time/<phase>, time/step)."""
    predicted: dict[str, float] = field(default_factory=dict)
    mape: dict[str, float] = field(default_factory=dict)
    """Per key, as a fraction (0.05 = 5 %)."""

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "steps": self.steps, "measured": self.measured, "predicted": self.predicted,
                "mape": self.mape}


def compare(preds: Sequence[StepPrediction]) -> RunReport:
    """Means and MAPE of every time key a run measured and the planner predicts."""
    keys = [f"time/{p}" for p in PHASE_KEYS] + ["time/step"]
    rep = RunReport(preds[0].run if preds else "-", len(preds))
    for k in keys:
        pairs: list[tuple[float, float]] = []
        for sp in preds:
            p, m = sp.prediction.measured_keys().get(k), sp.measured.get(k)
            if p is not None and m is not None:
                pairs.append((p, m))
        if not pairs or all(m == 0 for _, m in pairs):
            continue
        rep.measured[k] = sum(m for _, m in pairs) / len(pairs)
        rep.predicted[k] = sum(p for p, _ in pairs) / len(pairs)
        errs = [abs(p - m) / m for p, m in pairs if m > 0]
        if errs:
            rep.mape[k] = sum(errs) / len(errs)
    return rep


def overall_step_mape(reports: Sequence[RunReport]) -> float | None:
    """Mean over runs of each run's step-time MAPE."""
    vals = [r.mape["time/step"] for r in reports if "time/step" in r.mape]
    return sum(vals) / len(vals) if vals else None


def render(reports: Sequence[RunReport]) -> str:
    out = []
    for r in reports:
        rows = [("time", "measured", "predicted", "MAPE")]
        for k in r.measured:
            m = r.mape.get(k)
            rows.append((k, secs(r.measured[k]), secs(r.predicted[k]), f"{100 * m:.1f} %" if m is not None else "-"))
        out.append(f"run {r.run} ({r.steps} steps):\n" + table(rows))
    total = overall_step_mape(reports)
    if total is not None:
        out.append(f"step-time MAPE over {len(reports)} run(s): {100 * total:.1f} %")
    return "\n\n".join(out)
