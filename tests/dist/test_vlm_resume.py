"""Checkpoint and resume with pictures: a ``vlm_shapes`` run (a random-init Qwen2-VL, one rank,
fsdp and hf taking turns) stopped after 2 steps and resumed to 4 equals an uninterrupted 4-step run
bit for bit: its rewards, losses and gradient norms, and the trainer's weights and optimizer state in
the last checkpoint. The resumed run draws the same prompts (their pictures with them) from the
restored data stream and samples from the restored random streams."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = [pytest.mark.dist, pytest.mark.full]  # three launches: ~95 s on a loaded 2-core machine

RUN = ["experiment=vlm_shapes", "algo.prompts_per_step=8", "algo.samples_per_prompt=8"]


def run(run_dir: Path, steps: int):
    return launch([f"run_dir={run_dir}", *RUN, f"steps={steps}"], run_dir.parent, timeout=280)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_state(run_dir: Path) -> dict:
    """The trainer's tensors (model and optimizer state) in the run's last checkpoint."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    out = run_dir / "actor_train.pt"
    dcp_to_torch_save(last / "actor_train", out)
    return torch.load(out)


def test_two_steps_resumed_to_four_equal_four_with_pictures(run_root: Path) -> None:
    import torch

    whole, split = run_root / "whole", run_root / "split"
    for d, steps in ((whole, 4), (split, 2), (split, 4)):
        done = run(d, steps)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "resuming from" in done.stdout and "step_000001" in done.stdout, done.stdout[-2000:]
    a, b = rows(whole), rows(split)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    keys = ("reward_mean", "tokens/total", "tokens/generated", "train/pg_loss", "train/grad_norm")
    assert [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]
    # the prompts carry their pictures' image tokens, and the weights move (else equality means little)
    assert all(r["tokens/total"] / r["samples"] > 40 for r in a), a
    assert any(r.get("train/grad_norm", 0) > 0 for r in a[2:]), a
    w, s = last_state(whole), last_state(split)
    assert sorted(w) == sorted(s) and any(k.startswith("optim.") for k in w), sorted(w)[:5]
    differ = [k for k in w if isinstance(w[k], torch.Tensor) and not torch.equal(w[k], s[k])]
    differ += [k for k in w if not isinstance(w[k], torch.Tensor) and w[k] != s[k]]
    assert not differ, differ[:10]
