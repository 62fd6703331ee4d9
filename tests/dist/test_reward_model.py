"""The reward role as a model on GPUs: a sequence-classification model (fsdp, colocated with the
actor) scores every response, weighed with the rule reward; with the model's weight at 0 the run is
the CPU rule-reward run exactly, so the weights, the dispatch and the combination are what they say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.dist

RUN = ["steps=3", "algo.prompts_per_step=8", "algo.samples_per_prompt=4",
       "data.reward_fn=rlbatch.rewards.rules:format_reward"]
GPU_REWARD = ["roles.reward.device_mapping=[0,1]", "roles.reward.backend=fsdp:d2", "roles.reward.world_size=null"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def scores_of_a_model(model: list[dict]) -> None:
    """The stand-in reward model's scores are real numbers, different per response (not the rule's 0/1)."""
    assert all(r["reward_std"] > 0 for r in model)
    assert any(r["reward_mean"] not in (0.0, 1.0) for r in model)


def test_a_reward_model_on_gpu_ranks_scores_the_responses(run_root: Path) -> None:
    """The fast tier's: the reward role as a model on the GPU ranks (fsdp) scores each step's responses."""
    out = launch([*RUN, *GPU_REWARD, f"run_dir={run_root / 'model'}"], run_root, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    scores_of_a_model(rows(run_root / "model"))


@pytest.mark.full
def test_reward_model_on_gpus_scores_and_weighs_with_the_rule(run_root: Path) -> None:
    runs = {"cpu": [], "rule-only": [*GPU_REWARD, "reward_model.model_weight=0", "reward_model.rule_weight=1"],
            "model": GPU_REWARD, "model-packed": [*GPU_REWARD, "+roles.reward.engine_args.max_tokens_per_micro_batch=40"]}
    for name, extra in runs.items():
        out = launch([*RUN, *extra, f"run_dir={run_root / name}"], run_root, timeout=400)
        assert out.returncode == 0, out.stderr[-3000:]
    keys = ("reward_mean", "reward_std", "train/pg_loss", "train/grad_norm")
    assert [[r[k] for k in keys] for r in rows(run_root / "cpu")] == \
        [[r[k] for k in keys] for r in rows(run_root / "rule-only")]
    model = rows(run_root / "model")
    scores_of_a_model(model)
    assert [r["reward_mean"] for r in model] != [r["reward_mean"] for r in rows(run_root / "cpu")]

    # Packed rows (whole sequences, the score read at each one's last token) score the first step's
    # responses (the same ones: same seed, same weights) as padded rows do, to float32 rounding of
    # a mean of 32 scores (a later step's samples follow the rewards, so they may part).
    first, packed = model[0], rows(run_root / "model-packed")[0]
    for k in ("reward_mean", "reward_std"):
        assert packed[k] == pytest.approx(first[k], rel=1e-4, abs=1e-5), k
