"""Issue 47's planner check on recorded CPU runs (tests/data/inflight_runs/, see its README): calibrated on
the synchronous run of a long-tail workload, the planner predicts the step of the same workload run
asynchronously and with in-flight updates and partial rollouts (``rlbatch/plan/inflight.py``). Pure
arithmetic on small metrics files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rlbatch.config.hardware import load_hardware
from rlbatch.plan.calibrate import calibrate
from rlbatch.plan.report import compare
from rlbatch.plan.runs import RunModel, load_run

RUNS = Path(__file__).resolve().parents[2] / "data" / "inflight_runs"
SKIP = 3
"""The benchmark's warm-up steps (start-up, the first compilations)."""


def test_the_in_flight_step_is_predicted_within_the_asynchronous_modes_error() -> None:
    hw = load_hardware("cpu")
    models = {name: RunModel(load_run(RUNS / name), hw) for name in ("sync", "async", "inflight")}
    coef = calibrate([models["sync"]], SKIP, hw.name)
    mape = {n: compare(m.predict_steps(coef, SKIP)).mape["time/step"] for n, m in models.items()}
    # measured when recorded: 14.1 % (the fitted run), 16.2 %, 15.2 % (README)
    assert mape["sync"] <= 0.20, mape
    assert mape["inflight"] <= max(mape["async"], mape["sync"]) + 0.02, mape
    assert mape["inflight"] <= 0.25, mape
    # the same run predicted as a plain asynchronous one (its tail waited for each step): further off
    # (18.0 % against 15.2 % when recorded)
    run = models["inflight"].run
    algo = replace(run.cfg.algo, in_flight_updates=False, partial_rollouts=False)
    plain = RunModel(replace(run, cfg=replace(run.cfg, algo=algo)), hw)
    assert compare(plain.predict_steps(coef, SKIP)).mape["time/step"] > mape["inflight"] + 0.01, mape
