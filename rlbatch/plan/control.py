"""The control plane's overhead a step as a function of the world's ranks: ``a + b*N + c*N*log2(N)``
seconds, fitted to what ``tools/bench/scale.py`` measured (non-negative coefficients, least squares).

``a`` is what a step costs the controller whatever the world (the loop, its metrics), ``b`` what
each rank adds (its commands and replies, its moves), ``c`` whatever grows faster (sorting, probing).
``MEASURED`` is the fit of the table in docs/benchmarks.md; the planner adds its prediction to each
step (``Prediction``'s ``control`` line) so that a plan at 4096 ranks shows what one controller costs.
Pure arithmetic: no torch, no numpy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    ranks: int
    seconds: float
    """The controller's overhead a step (wall time outside engine work) at ``ranks``."""


@dataclass(frozen=True)
class ControlModel:
    a: float
    b: float
    c: float
    source: str = ""
    """Where the coefficients come from (a benchmark and its machine)."""

    def overhead_s(self, ranks: int) -> float:
        n = max(int(ranks), 1)
        return self.a + self.b * n + self.c * n * math.log2(n)

    def describe(self) -> str:
        return (f"overhead = {self.a * 1e3:.2f} ms + {self.b * 1e3:.4f} ms x N + {self.c * 1e3:.5f} ms x N log2 N"
                + (f" ({self.source})" if self.source else ""))


def _terms(n: int) -> tuple[float, float, float]:
    return (1.0, float(n), n * math.log2(max(n, 1)))


def _solve(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Solve the normal equations (Gauss-Jordan with partial pivoting); None when singular."""
    k = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, rhs, strict=True)) for i in range(k)]
    m = [ata[i] + [aty[i]] for i in range(k)]
    for col in range(k):
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12 * max(1.0, max(abs(v) for v in m[piv])):
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] for i in range(k)]


def fit(points: Sequence[Point], source: str = "") -> ControlModel:
    """The least-squares fit of ``a + b*N + c*N*log2 N`` with every coefficient >= 0: the best of
    the fits over each subset of the three terms whose coefficients come out non-negative (the
    exact non-negative least squares for three terms). Relative error is minimised (each point
    weighted by 1/seconds), so small worlds count as much as large ones."""
    pts = [p for p in points if p.seconds > 0]
    if not pts:
        raise ValueError(f"fit: no point with a positive overhead among {list(points)}")
    best: tuple[float, list[float]] | None = None
    for size in (3, 2, 1):
        for subset in itertools.combinations(range(3), size):
            if len(pts) < size:
                continue
            rows = [[_terms(p.ranks)[i] / p.seconds for i in subset] for p in pts]
            coef = _solve(rows, [1.0] * len(pts))
            if coef is None or any(c < 0 for c in coef):
                continue
            full = [0.0, 0.0, 0.0]
            for i, c in zip(subset, coef, strict=True):
                full[i] = c
            err = sum((sum(t * c for t, c in zip(_terms(p.ranks), full, strict=True)) / p.seconds - 1) ** 2 for p in pts)
            if best is None or err < best[0] - 1e-15:
                best = (err, full)
    assert best is not None  # a single term always fits with a positive coefficient
    a, b, c = best[1]
    return ControlModel(a, b, c, source)


MEASURED = ControlModel(0.0047474, 0.00023385, 0.0000083352, "fit of the controller's busy CPU a step at 8-256 "
                                                                "ranks, docs/benchmarks.md 'Scale'")
"""The fit of docs/benchmarks.md's scale table (``tools/bench/scale.py``, 2026-12-07, a 2-core VM): the
controller's busy CPU seconds a step (its CPU less the polls that found no reply yet, with a CPU of
its own) at 8, 16, 32, 64, 128 and 256 ranks (light ranks: no torch.distributed world, forked from a
zygote per node). ``tools/bench/scale_sim.py``, the controller alone against stand-in ranks, measured
2.6-3.1% of a 30 s step at 4096 ranks without the MPI calls; this fit gives 4.6% with them."""


def control_line(ranks: int, step_s: float, model: ControlModel = MEASURED) -> str:
    """One line for a plan: the predicted control overhead a step at ``ranks`` and its share of
    the step the planner predicts."""
    x = model.overhead_s(ranks)
    share = f" = {100 * x / step_s:.2f}% of the predicted {step_s:.1f} s step" if step_s > 0 else ""
    return f"control plane: ~{x * 1e3:.0f} ms a step at {ranks} ranks{share} (rlbatch.plan.control, {model.source})"
