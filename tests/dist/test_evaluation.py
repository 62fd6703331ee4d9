"""Held-out evaluation on real processes (local mpiexec, gloo, CPU): it leaves training bitwise as
it was, its metrics land in the rows of the steps it follows, and a resumed run keeps them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.dist
QUICK = ["algo.prompts_per_step=8", "algo.samples_per_prompt=4", "seed=3",
         "data.reward_fn=rlbatch.rewards.rules:format_reward"]  # some reward at once: a digit, then <eos>
EVAL = ["eval.every=2", "eval.at_start=true", "eval.samples_per_prompt=2", "eval.temperature=1.0", "eval.max_prompts=40"]
ALONGSIDE = ["eval.every=2", "eval.at_start=true", "eval.samples_per_prompt=4", "eval.temperature=1.0"]
"""All 100 problems, 4 samples each, generated 8 at a time (``DISAGGREGATED``): a generation that lasts
many times the few milliseconds the trainer takes to start its phases, so the two meet on a loaded machine."""
DISAGGREGATED = ["roles=disaggregated", "+roles.actor_infer.engine_args.max_batch=8"]
NOT_TRAINING = ("time/", "at/", "host/", "mem/", "idle/", "overlap/", "offload/", "reload/", "eval/")
"""Metrics that are not the training run's own: wall times, memory, transfers (an evaluation leaves
the inference engine resident, so the next phase reloads less) and evaluation."""


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NOT_TRAINING)}


@pytest.mark.full
def test_evaluation_leaves_training_bitwise_alone_and_survives_a_resume(run_root: Path) -> None:
    plain, evaluated = run_root / "plain", run_root / "eval"
    out = launch(["steps=4", f"run_dir={plain}", *QUICK], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # sampled evaluation (temperature 1, two samples per prompt) on the inference ranks, which the
    # colocated placement shares with the trainer; stopped after 3 steps and resumed to 4
    out = launch(["steps=3", f"run_dir={evaluated}", *QUICK, *EVAL], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first = (evaluated / "metrics.jsonl").read_text().splitlines()
    out = launch(["steps=4", f"run_dir={evaluated}", *QUICK, *EVAL], run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (evaluated / "metrics.jsonl").read_text().splitlines()[:3] == first  # kept, not evaluated again

    a, b = rows(plain), rows(evaluated)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    assert [training(r) for r in a] == [training(r) for r in b]
    assert {"reward_mean", "train/pg_loss", "train/grad_norm", "tokens/generated"} <= set(training(a[0]))
    assert len({r["train/grad_norm"] for r in a}) == 4 and any(r["reward_mean"] > 0 for r in a)  # it has teeth
    assert not any(k.startswith("eval/") for r in a for k in r)

    # step 0: the initial weights (at_start); 1: every 2nd; 2: the last step of the first launch; 3: both
    assert [r["eval/updates"] for r in b] == [0.0, 2.0, 3.0, 4.0]
    check_evaluations(b, prompts=40)
    # between steps: the inference ranks are the trainer's, so nothing ran alongside training
    assert [(r["eval/overlapped"], r["eval/overlap_seconds"]) for r in b] == [(0.0, 0.0)] * 4
    assert "evaluation: 40 prompts x 2 samples" in out.stdout and "eval_pass@1=" in out.stdout  # the progress line
    assert "between steps" in out.stdout
    assert (evaluated / "eval_curve.png").stat().st_size > 1000 and not (plain / "eval_curve.png").exists()


def test_evaluation_alongside_training_leaves_it_bitwise_alone(run_root: Path) -> None:
    """Disaggregated: actor_infer and the reward worker on ranks of their own, so the evaluation of
    the initial weights runs during step 0 and that of the weights after step 1 during step 2, each
    queued behind the step's generation while the trainer takes log-probs and trains."""
    plain, evaluated = run_root / "plain", run_root / "eval"
    for run_dir, more in ((plain, []), (evaluated, ALONGSIDE)):
        out = launch([*DISAGGREGATED, "steps=3", f"run_dir={run_dir}", *QUICK, *more], run_root)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "alongside the next step's training" in out.stdout

    a, b = rows(plain), rows(evaluated)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    assert [training(r) for r in a] == [training(r) for r in b]
    assert len({r["train/grad_norm"] for r in a}) == 3 and any(r["reward_mean"] > 0 for r in a)  # it has teeth
    assert not any(k.startswith("eval/") for r in a for k in r)

    # rows 0 and 1 ran alongside steps 0 and 2; the last step's runs before its checkpoint, between steps
    assert [(r["eval/updates"], r["eval/overlapped"]) for r in b] == [(0.0, 1.0), (2.0, 1.0), (3.0, 0.0)]
    check_evaluations(b, prompts=100)
    # the evaluations' phases (on the inference and reward ranks) ran while the trainer's ran: the
    # wall-clock spans of their ranks' records intersect; not so between steps
    assert b[0]["eval/overlap_seconds"] > 0 and b[1]["eval/overlap_seconds"] > 0, b
    assert b[2]["eval/overlap_seconds"] == 0.0
    assert all(r["eval/seconds"] > 0 for r in b)


def check_evaluations(evaluated: list[dict], prompts: int) -> None:
    for r in evaluated:
        assert r["eval/all/prompts"] == prompts
        assert 0.0 <= r["eval/all/pass@1"] <= r["eval/all/pass@2"] <= 1.0
        assert 0.0 <= r["eval/all/mean_reward"] <= 1.0 and r["eval/all/response_len_mean"] > 0
    assert any(r["eval/all/pass@1"] > 0 for r in evaluated)
