"""The planner's model of the control overhead (``rlbatch.plan.control``): the fit recovers the
coefficients of points it was made from, never goes negative, and the plan prints its prediction."""

from __future__ import annotations

import math

import pytest

from rlbatch.plan.control import ControlModel, Point, control_line, fit


@pytest.mark.parametrize(("a", "b", "c"), [(0.01, 0.002, 0.0), (0.005, 0.0, 0.0003), (0.02, 0.001, 0.0001)])
def test_the_fit_recovers_the_coefficients_of_exact_points(a: float, b: float, c: float) -> None:
    truth = ControlModel(a, b, c)
    model = fit([Point(n, truth.overhead_s(n)) for n in (4, 8, 16, 32, 64)])
    for n in (1024, 4096):
        assert model.overhead_s(n) == pytest.approx(truth.overhead_s(n), rel=1e-6)


def test_coefficients_stay_non_negative_where_the_unconstrained_fit_would_not() -> None:
    """Points that fall with N (noise at small N) would give a negative slope: the fit keeps every
    term at zero or above, so a prediction never falls as the world grows."""
    model = fit([Point(4, 0.030), Point(8, 0.020), Point(16, 0.021), Point(32, 0.022)])
    assert min(model.a, model.b, model.c) >= 0
    assert model.overhead_s(4096) >= model.overhead_s(32) >= model.overhead_s(4) > 0


def test_no_usable_point_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="positive overhead"):
        fit([Point(8, 0.0)])


def test_the_plan_line_names_ranks_and_share_of_the_step() -> None:
    model = ControlModel(0.01, 0.001, 0.0, "test")
    line = control_line(1000, 10.0, model)
    assert "~1010 ms a step at 1000 ranks = 10.10% of the predicted 10.0 s step" in line
    assert math.isclose(model.overhead_s(1), 0.011)
