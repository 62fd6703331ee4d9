"""Fit the time model's coefficients to real runs.

    python -m rlbatch.plan calibrate runs/a runs/b -o plan-profile.yaml [hardware=cpu]

For each phase kind the fit finds one efficiency factor ``g`` that scales all its features, and
small per-feature corrections ``u`` (coef = prior * exp(g + u)), by Gauss-Newton on the log of
predicted over measured time with a ridge penalty on ``u`` only. One run fixes ``g`` (every
feature scales alike: the classic per-phase efficiency factor); runs that mix the features
differently (other placements, sizes) move the ``u`` apart. The controller's per-step overhead
is then the mean of measured step time minus the predicted critical path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rlbatch.plan.coefficients import KINDS, Coefficients, prior
from rlbatch.plan.runs import RunModel, StepPrediction

RIDGE = 0.05
"""Weight of the penalty rows on per-feature log-corrections, against weight 1 for each step's log
error: the model's expected log error (~5 %) over the prior's spread of a log-multiplier (~1)."""
ITERATIONS = 30


def fit_kind(kind: str, rows: Sequence[tuple[dict[str, float], float]], ridge: float | None = None) -> dict[str, float]:
    """Coefficients of one phase kind from (features, measured seconds) rows."""
    rows = [(f, y) for f, y in rows if y > 0 and any(v > 0 for v in f.values())]
    if not rows:
        return {}
    names = sorted({k for f, _ in rows for k, v in f.items() if v > 0})
    a = np.array([[f.get(k, 0.0) * prior(kind, k) for k in names] for f, _ in rows])  # seconds at the priors
    logy = np.log([y for _, y in rows])
    v = np.zeros(len(names) + 1)  # [g, u_1..u_m]
    w = RIDGE if ridge is None else ridge  # fixed: more steps and runs let the data outweigh the prior
    for _ in range(ITERATIONS):
        c = a * np.exp(v[0] + v[1:])
        yhat = c.sum(axis=1)
        r = np.log(yhat) - logy
        jac = np.hstack([np.ones((len(rows), 1)), c / yhat[:, None]])
        reg_j = np.hstack([np.zeros((len(names), 1)), w * np.eye(len(names))])
        big_j = np.vstack([jac, reg_j])
        big_r = np.concatenate([r, w * v[1:]])
        step, *_ = np.linalg.lstsq(big_j, -big_r, rcond=None)
        v += np.clip(step, -2.0, 2.0)  # damped: a feature far too small must not overshoot
        if np.abs(step).max() < 1e-9:
            break
    return {k: float(prior(kind, k) * math.exp(v[0] + v[i + 1])) for i, k in enumerate(names)}


def _rows(preds: Sequence[StepPrediction]) -> dict[str, list[tuple[dict[str, float], float]]]:
    rows: dict[str, list[tuple[dict[str, float], float]]] = {k: [] for k in KINDS}
    for sp in preds:
        for t in sp.prediction.phases:
            y = sp.measured.get(f"time/{t.name}")
            if y is not None:
                # the features are one round's; dynamic sampling measured every round of the step
                rounds = sp.prediction.workload.generation_rounds if t.kind in ("generate", "reward") else 1.0
                rows[t.kind].append((t.features, y / rounds))
        for d in ("offload", "reload"):
            y = sp.measured.get(f"time/{d}")
            if y is not None and sp.prediction.transitions[d]:
                rows[d].append((sp.prediction.transitions[d], y))
    return rows


def calibrate(models: Sequence[RunModel], skip: int = 1, hardware: str = "") -> Coefficients:
    """Fit coefficients to every step (after ``skip`` warm-up steps) of every run."""
    prior_coef = Coefficients(hardware=hardware)
    preds = [sp for m in models for sp in m.predict_steps(prior_coef, skip)]
    rows = _rows(preds)
    coef = Coefficients({k: fit_kind(k, rows[k]) for k in KINDS if k != "step" and rows[k]}, hardware,
                        [str(m.run.path) for m in models])
    coef.values["step"] = {"fixed": 0.0}
    residuals = [sp.measured["time/step"] - sp.prediction.step_s
                 for m in models for sp in m.predict_steps(coef, skip) if "time/step" in sp.measured]
    coef.values["step"]["fixed"] = float(np.mean(residuals)) if residuals else prior("step", "fixed")
    return coef
