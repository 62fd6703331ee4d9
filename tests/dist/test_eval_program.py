"""program=eval on real processes (local mpiexec, gloo, CPU): a training run's checkpoints evaluated
without training give the held-out numbers the run logged for their steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.dist
QUICK = ["algo.prompts_per_step=8", "algo.samples_per_prompt=4", "seed=3",
         "data.reward_fn=rlbatch.rewards.rules:format_reward", "eval.max_prompts=40"]
"""Greedy evaluation of 40 prompts, rewarded for a digit then <eos>: the weights after one update
score 0 and after two 0.225 (seed 3), so equal numbers are the same weights evaluated."""


def evaluations(rows: list[dict]) -> list[dict]:
    """The held-out numbers of each row (not their wall times)."""
    return [{k: v for k, v in r.items() if k.startswith("eval/") and k not in ("eval/seconds", "eval/overlapped",
                                                                                "eval/overlap_seconds")}
            for r in rows]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_of_a_runs_checkpoints_gives_the_numbers_training_logged(run_root: Path) -> None:
    trained, evaluated = run_root / "train", run_root / "eval"
    out = launch(["steps=2", "save_every=1", "eval.every=1", f"run_dir={trained}", *QUICK], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    before = {p: p.read_bytes() for p in trained.rglob("*") if p.is_file() and "logs" not in p.parts}

    refused = launch(["program=eval", f"eval.checkpoint={trained}", f"run_dir={trained}", *QUICK], run_root)
    assert refused.returncode == 2 and f"run_dir: {trained} holds a training run" in refused.stdout + refused.stderr

    out = launch(["program=eval", f"eval.checkpoint={trained}", "eval.all_checkpoints=true", f"run_dir={evaluated}",
                  *QUICK], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    logged, got = evaluations(read(trained / "metrics.jsonl")), evaluations(read(evaluated / "eval.jsonl"))
    assert got == logged and [r["eval/updates"] for r in got] == [1.0, 2.0]
    assert got[0]["eval/all/mean_reward"] != got[1]["eval/all/mean_reward"]  # two different policies
    assert [r["step"] for r in read(evaluated / "eval.jsonl")] == [0, 1]
    line = f"eval: {trained}/checkpoints/step_000001 (step 1, 2 updates): pass@1 {got[1]['eval/all/pass@1']:.3f}"
    assert line in out.stdout
    assert not (evaluated / "metrics.jsonl").exists() and not (evaluated / "checkpoints").exists()
    assert {p: p.read_bytes() for p in trained.rglob("*") if p.is_file() and "logs" not in p.parts} == before
