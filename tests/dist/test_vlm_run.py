"""A vision-language policy in a real run: ``experiment=vlm_shapes`` (a random-init Qwen2-VL, its
vision tower frozen, prompts with pictures) trains with fsdp and generates with hf, over two ranks
each. The pictures go from the controller to the generate ranks with their prompts, and the image
fields on to the trainers: the trainer's log-probs of the sampled tokens equal the engine's (the
off-policy metrics compare them), which they do not when the trainer sees the text alone (0.02
nats apart). The engines' image path alone: tests/unit/test_vlm_engines.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch, rank_logs

pytestmark = pytest.mark.dist


def test_a_vlm_trains_on_pictures_with_fsdp_and_generates_with_hf(run_root: Path) -> None:
    run = run_root / "run"
    out = launch(["experiment=vlm_shapes", "roles.actor_train.backend=fsdp:d2", "roles.actor_infer.backend=hf:d2",
                  "roles.actor_train.device_mapping=[0,1]", "roles.actor_infer.device_mapping=[2,3]",
                  "steps=2", f"run_dir={run}", "algo.prompts_per_step=4", "algo.samples_per_prompt=4",
                  "algo.max_new_tokens=3", "algo.off_policy=tis"], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    # each prompt: the question's tokens and its picture's 4 image tokens between vision start/end
    assert all(r["tokens/total"] / r["samples"] > 40 for r in rows), rows
    gaps = [r["train/offpolicy/abs_log_ratio_mean"] for r in rows if "train/offpolicy/abs_log_ratio_mean" in r]
    assert gaps and max(gaps) < 1e-3, gaps
    logs = rank_logs(run)
    for role, engine in (("actor_train", "fsdp"), ("actor_infer", "hf")):
        assert logs.count(f"built {engine} engine for {role}") == 2, (role, logs[-3000:])
