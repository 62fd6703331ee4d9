"""A vision-language policy generating with vLLM (its CPU build, through rlbatch's vLLM plugin:
rlbatch/engines/vllm/vlm_plugin.py, images.py) and training with fsdp, colocated on one rank:
``experiment=vlm_shapes`` for 2 steps. The pictures go from the controller to the vLLM engine with
their prompts and the image fields on to the trainer, whose log-probs of the sampled tokens equal
vLLM's within the text path's tolerance (1e-4; the off-policy metrics compare them). The trainer's
log-probs from the prompt text alone differ by about 0.02 nats (tests/dist/test_vlm_run.py), and
the second step compares again after the first step's update reached vLLM by the weight sync. The
engine alone: tests/unit/test_vllm_vlm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch, rank_logs

pytestmark = [pytest.mark.dist, pytest.mark.full]  # vLLM starts in 1-4 minutes on a loaded 2-core machine

# vLLM's CPU attention needs head_dim >= 32: the tiny decoder (hidden 64) with 2 heads
MODEL = ["model.num_heads=2", "model.num_kv_heads=1"]


@pytest.mark.timeout(900)
def test_a_vlm_trains_with_fsdp_on_pictures_vllm_generated_from(run_root: Path) -> None:
    run = run_root / "run"
    out = launch(["experiment=vlm_shapes", "roles.actor_infer.backend=vllm:d1", *MODEL, "steps=2", f"run_dir={run}",
                  "algo.prompts_per_step=8", "algo.samples_per_prompt=8", "algo.off_policy=tis"], run_root, timeout=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # each prompt: the question's tokens and its picture's 4 image tokens between vision start/end
    assert all(r["tokens/total"] / r["samples"] > 40 and r["tokens/generated"] > 0 for r in rows), rows
    gaps = [r.get("train/offpolicy/abs_log_ratio_mean") for r in rows]
    assert all(g is not None for g in gaps) and max(gaps) < 1e-4, gaps
    assert rows[0]["train/grad_norm"] > 0, rows  # the first step's update moves the weights the second generates with
    logs = rank_logs(run)
    assert logs.count("built vllm engine for actor_infer") == 1, logs[-3000:]
    assert logs.count("built fsdp engine for actor_train") == 1, logs[-3000:]
