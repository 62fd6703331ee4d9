"""PPO with the critic on the megatron engine: ``algo=ppo roles.actor_train.backend=megatron:t2`` (the
critic and the reference inherit megatron:t2), against the same run on fsdp. Both start from the
same weights and the same seed, so the first step generates the same responses and gets the same
rewards; the critic's values start at 0 (a zero head) and its first update must match fsdp's to
float rounding. The megatron critic exports with ``python -m rlbatch.export --role critic`` as a
transformers token-classification model. On this CPU machine the test-only shim reaches every rank
through the plugin mechanism (docs/megatron.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch
from tests.dist.test_resume import export

pytestmark = pytest.mark.dist

RUN = ["algo=ppo", "steps=1", "algo.prompts_per_step=8", "algo.samples_per_prompt=4", "algo.mini_batches=1",
       "algo.loss_agg=seq", "seed=17"]
"""One update on the whole batch, the loss a mean over responses: fsdp:d2 gives each rank 16 of the 32
responses and averages the gradients, megatron:t2 (one data-parallel replica) takes all 32 at once,
and the two are the same sum. (With a token mean, or two mini-batches, they differ by design.)
Seed 17: one of the 32 first responses is right (the untrained policy answers right about once in
300), so the returns, and the critic's update, are not all zero."""
TOL = 1e-4
"""Relative: the engines sum in other orders (TP-split matmuls), ~1e-6 apart in fp32; a critic
that read the wrong positions, or a head split over TP, is off by far more."""


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.full
@pytest.mark.timeout(900)
def test_ppo_with_a_megatron_t2_critic_matches_fsdp_and_exports(run_root: Path) -> None:
    import torch
    from safetensors.torch import load_file

    runs = {"fsdp": [], "megatron": ["roles.actor_train.backend=megatron:t2", "plugins=[tests.plugins.megatron_cpu]"]}
    for name, extra in runs.items():
        out = launch([*RUN, *extra, f"run_dir={run_root / name}"], run_root, timeout=420)
        assert out.returncode == 0, out.stderr[-3000:]
    (f,), (m,) = rows(run_root / "fsdp"), rows(run_root / "megatron")
    assert m["reward_mean"] == f["reward_mean"] and m["tokens/generated"] == f["tokens/generated"]
    assert f["reward_std"] > 0, "no reward signal: the critic would have nothing to learn"
    # The actor's gradient norm also checks that the pad token, sampled inside a response, passes no
    # gradient to its embedding row through the lookup (transformers' padding_idx): without that,
    # megatron's norm was 5.16 against fsdp's 4.77 in this step.
    for key in ("train/critic/value_loss", "train/critic/grad_norm", "critic/explained_variance", "train/pg_loss",
                "train/grad_norm"):
        assert m[key] == pytest.approx(f[key], rel=TOL), (key, m[key], f[key])
    assert m["train/critic/grad_norm"] > 0
    export(run_root / "fsdp", run_root / "e_fsdp", "critic")
    export(run_root / "megatron", run_root / "e_megatron", "critic")
    a, b = load_file(run_root / "e_fsdp" / "model.safetensors"), load_file(run_root / "e_megatron" / "model.safetensors")
    assert a.keys() == b.keys() and {"score.weight", "score.bias"} <= a.keys()
    assert not torch.equal(b["score.weight"], torch.zeros_like(b["score.weight"])), "the critic's head did not train"
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < TOL, f"exported critics differ by {worst}"
    config = json.loads((run_root / "e_megatron" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForTokenClassification")
