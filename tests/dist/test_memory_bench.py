"""tools/bench/memory.py end to end on a 2-layer model: the code path of the 0.5B measurement
(docs/benchmarks.md, "Host memory"), in seconds. The figures of so small a model are the processes'
own; what is checked is that every phase is measured and the planner is not below any of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.dist, pytest.mark.full]  # a benchmark run as a test


def test_memory_bench_measures_every_phase_within_the_planner(run_root: Path) -> None:
    out = run_root / "result.json"
    res = subprocess.run([sys.executable, str(REPO_ROOT / "tools/bench/memory.py"), "--size", "tiny", "--steps", "2",
                          "--out", str(run_root), "--json", str(out)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["phase"]: r for r in result["rows"]}
    assert list(rows) == ["startup", "generate", "ref_logprobs", "train", "sync"]
    for phase, r in rows.items():
        assert 0 < r["floor"] < r["measured"] <= r["planner"], (phase, r)
    assert "planner >= measured, train" in res.stdout and "start-up beyond the floor" in res.stdout
