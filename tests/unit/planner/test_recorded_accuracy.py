"""Issue 6 ("Accuracy") on recorded CPU runs of the default experiment (tests/data/runs/, see its
README): calibrate on the ``colocated`` run only, then predict the step time of the other
placements and sizes. Pure arithmetic on small metrics files: no subprocess, well under a second.
"""

from __future__ import annotations

from pathlib import Path

from rlbatch.config.hardware import load_hardware
from rlbatch.plan.calibrate import calibrate
from rlbatch.plan.report import compare
from rlbatch.plan.runs import RunModel, load_run

RUNS = Path(__file__).resolve().parents[2] / "data" / "runs"
CALIBRATION_RUN = "colocated"
LLC_BYTES = 35.8 * 2**20
"""L3 of the VM that recorded the runs (lscpu); the cpu profile leaves it unset."""
SKIP = 1
"""Warm-up steps ignored per run (the first step's calls are slower: first-use allocations)."""


def _step_mapes() -> tuple[float, dict[str, float]]:
    hw = load_hardware("cpu", {"llc_bytes": LLC_BYTES})
    models = {p.name: RunModel(load_run(p), hw) for p in sorted(RUNS.iterdir()) if (p / "metrics.jsonl").is_file()}
    coef = calibrate([models[CALIBRATION_RUN]], SKIP, hw.name)
    mapes = {n: compare(m.predict_steps(coef, SKIP)).mape["time/step"] for n, m in models.items()}
    return mapes.pop(CALIBRATION_RUN), mapes


def test_recorded_runs_cover_four_placements_or_sizes():
    _, others = _step_mapes()
    assert len(others) >= 4, sorted(others)


def test_calibration_run_reproduces_itself():
    own, _ = _step_mapes()
    assert own <= 0.10  # what is left is step-to-step noise of the shared machine


def test_step_time_error_meets_the_target():
    """Issue 6's target: at most 10 % step-time MAPE over the runs not fitted. Measured when the
    runs were recorded: 7.8 % over the four other runs, 9.3 % at worst (README)."""
    _, others = _step_mapes()
    assert sum(others.values()) / len(others) <= 0.10, others
    assert max(others.values()) <= 0.15, others
