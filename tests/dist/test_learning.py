"""The default experiment learns: GRPO alone takes a random-initialised model from chance to
the whole addition table (deterministic with the seed, so not flaky)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.dist


def rewards(run_dir: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_reward_rises_in_a_short_run(run_root: Path) -> None:
    out = launch(["steps=20", f"run_dir={run_root / 'run'}"], run_root)
    assert out.returncode == 0, out.stderr[-3000:]
    r = rewards(run_root / "run")
    assert sum(r[-4:]) / 4 > sum(r[:4]) / 4 + 0.1, r


@pytest.mark.slow
def test_default_experiment_learns_the_task(run_root: Path) -> None:
    """The acceptance run: no overrides but the run directory."""
    out = launch([f"run_dir={run_root / 'run'}"], run_root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = rewards(run_root / "run")
    assert r[0] <= 0.2 and r[-1] >= 0.8, r
