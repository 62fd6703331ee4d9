"""The RL pipeline end to end on real processes (local mpiexec, gloo, CPU)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, launch

pytestmark = pytest.mark.dist
QUICK = ["algo.prompts_per_step=8", "algo.samples_per_prompt=4"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("roles", ["colocated", "disaggregated"])
def test_default_experiment_runs_and_writes_its_outputs(run_root: Path, roles: str) -> None:
    run = run_root / "run"
    out = launch([f"roles={roles}", "steps=3", f"run_dir={run}", *QUICK], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward_mean", "time/generate", "time/score", "time/ref_logprobs", "time/train", "time/sync",
                "time/step", "tokens/generated", "host/rss", "train/pg_loss", "train/lr"):
        assert key in rows[-1], key
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    if roles == "colocated":  # actor_train, actor_infer and reference take turns on each rank
        assert rows[-1]["offload/bytes"] > 0 and rows[-1]["reload/bytes"] > 0
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert "done: 3 steps" in out.stdout


@pytest.mark.full
def test_same_seed_same_run(run_root: Path) -> None:
    rewards = []
    for name in ("a", "b"):
        out = launch(["steps=2", f"run_dir={run_root / name}", "seed=7", *QUICK], run_root)
        assert out.returncode == 0, out.stderr[-3000:]
        rewards.append([(r["reward_mean"], r["tokens/generated"], r["train/pg_loss"]) for r in metrics(run_root / name)])
    assert rewards[0] == rewards[1]


def test_local_hf_model_and_jsonl_dataset(run_root: Path) -> None:
    """model.path loads a Hugging Face directory (weights, config, tokenizer); data comes from a
    jsonl file through HF datasets with a prompt template; the GSM8K-style config runs."""
    import torch

    from rlbatch.data.tokenizer import build_char_tokenizer
    from rlbatch.models.spec import spec_from_config
    from rlbatch.models.tiny import build_tiny_model

    alphabet = "".join(c for c in string.printable if not c.isspace())
    tok = build_char_tokenizer(alphabet)
    spec = spec_from_config({"max_position_embeddings": 1024, "initializer_range": 0.1}, vocab=len(tok))
    model = build_tiny_model(spec, seed=3, tokenizer=tok)
    model_dir = run_root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    del model, torch
    run = run_root / "run"
    out = launch(["experiment=gsm8k", f"model.path={model_dir}", f"data.path={REPO_ROOT / 'tests/data/gsm8k_sample.jsonl'}",
                  "steps=2", f"run_dir={run}", "algo.prompts_per_step=4", "algo.samples_per_prompt=2",
                  "algo.max_new_tokens=8"], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = metrics(run)
    assert len(rows) == 2 and rows[0]["tokens/generated"] > 0
    assert "Question:" in (run / "config.yaml").read_text()
