"""GRPO with SGLang generating (its CPU engine, with the stand-ins of tests/stand_ins: docs/sglang.md),
colocated with the trainer on both ranks: the fast tier's run of the sglang engine in the pipeline
(generation, the bucketed weight sync each step, offload beside the trainer). Its learning curve and
bitwise resume are the full tier's (tests/dist/test_learning.py, tests/dist/test_resume.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch, rank_logs, sglang_env

pytestmark = pytest.mark.dist


def test_grpo_with_sglang_generating(run_root: Path) -> None:
    run = run_root / "run"
    out = launch(["experiment=arithmetic_sglang", "steps=3", f"run_dir={run}"], run_root, env=sglang_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["tokens/generated"] > 0 and r["time/sync"] > 0 for r in rows)
    assert rank_logs(run).count("built sglang engine for actor_infer") == 2
