"""program=eval: what it is refused before start (something to evaluate, an eval set, scoring roles,
a checkpoint for this config's model, a run directory of its own), and its pieces that need no ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlbatch.checkpoint.store import CheckpointStore
from rlbatch.checks.validate import check
from rlbatch.loop.evaluate_only import checkpoints_to_evaluate, policy_version, summary
from rlbatch.worker import PROGRAMS
from tests.unit.configs import problems, set_


def checkpoints(run: Path, steps: list[int], model: dict[str, Any] | None = None) -> Path:
    """A run directory with committed checkpoints of ``steps`` (an actor_train directory, the
    run's config.yaml with ``model``, and the policy version) as a training run leaves them."""
    store = CheckpointStore(run / "checkpoints")
    for step in steps:
        stage = store.begin(step)
        (stage / "actor_train").mkdir()
        (stage / "actor_train" / "shard").write_bytes(b"x")
        (stage / "controller.json").write_text(f'{{"step": {step}, "policy_version": {2 * (step + 1)}}}')
        (stage / "config.yaml").write_text(yaml.safe_dump({"program": "train", "model": model or {}}))
        store.commit(step)
    return run


def test_eval_is_a_program_and_evaluates_a_checkpoint_or_a_model_directory(cfg: dict[str, Any], tmp_path: Path) -> None:
    assert PROGRAMS["eval"] == "rlbatch.loop.evaluate_only"
    run = checkpoints(tmp_path / "train", [0, 1])
    check(set_(cfg, program="eval", eval__checkpoint=str(run)))  # passes
    check(set_(cfg, program="eval", eval__checkpoint=str(run / "checkpoints" / "step_000000")))
    assert ("program=eval: nothing to evaluate: give eval.checkpoint=<a run directory or a checkpoint> or "
            "model.path=<a model directory> (a random-initialised model is not worth an evaluation)"
            ) in problems(set_(cfg, program="eval"))
    assert any(p.startswith("program:") and "'eval'" in p for p in problems(set_(cfg, program="evaluate")))


def test_eval_without_an_eval_set_or_scoring_is_refused_naming_the_field(cfg: dict[str, Any], tmp_path: Path) -> None:
    run = str(checkpoints(tmp_path / "train", [0]))
    ev = set_(cfg, program="eval", eval__checkpoint=run)
    assert any(p.startswith("eval.data.name: 'none' has no prompts, so program=eval has no eval set")
               for p in problems(set_(ev, eval__data__name="none")))
    held_out_file = set_(ev, data__name="file", data__path=str(tmp_path / "train.jsonl"), data__check_path=False)
    assert any(p.startswith("eval.data.name: 'synthetic' differs from data.name='file'") and "eval.data.path=" in p
               for p in problems(held_out_file, runnable=False))
    assert any(p.startswith("eval.data.path: eval.data.name=file needs the held-out jsonl or parquet file")
               for p in problems(set_(held_out_file, eval__data__name="file"), runnable=False))
    assert any(p.startswith("roles.reward: program=eval scores every response")
               for p in problems(set_(ev, roles__reward__enabled=False)))


def test_checkpoint_settings_belong_to_program_eval_and_a_checkpoint_must_fit_the_model(cfg: dict[str, Any],
                                                                                        tmp_path: Path) -> None:
    assert ("eval.checkpoint: set, but program=train: only program=eval reads it (a training run resumes from a "
            "checkpoint with resume=<path>)") in problems(set_(cfg, eval__checkpoint="runs/a"), runnable=False)
    assert any(p.startswith("eval.all_checkpoints: true, but eval.checkpoint is empty")
               for p in problems(set_(cfg, program="eval", model__path="/m", model__check_path=False,
                                      eval__all_checkpoints=True)))
    missing = problems(set_(cfg, program="eval", eval__checkpoint=str(tmp_path / "nowhere")))
    assert any(p.startswith(f"eval.checkpoint: {tmp_path / 'nowhere'}: no such checkpoint or run directory")
               for p in missing)
    other = checkpoints(tmp_path / "wide", [3], model={"hidden_size": 128, "max_position_embeddings": 128})
    [line] = [p for p in problems(set_(cfg, program="eval", eval__checkpoint=str(other))) if "another model" in p]
    assert "was written for another model (model.hidden_size=128 there, 64 here)" in line
    critic = set_(cfg, program="eval", eval__checkpoint=str(checkpoints(tmp_path / "a", [0])), algo__name="ppo",
                  roles__critic__enabled=True)
    assert any("has no critic/" in p for p in problems(critic))


def test_eval_refuses_a_run_directory_that_holds_a_training_run(cfg: dict[str, Any], tmp_path: Path) -> None:
    train = checkpoints(tmp_path / "train", [0])
    (train / "metrics.jsonl").write_text('{"step": 0}\n')
    (train / "config.yaml").write_text("program: train\n")
    before = {p: p.read_bytes() for p in train.rglob("*") if p.is_file()}
    [line] = [p for p in problems(set_(cfg, program="eval", eval__checkpoint=str(train), run_dir=str(train)))
              if p.startswith("run_dir:")]
    assert line.startswith(f"run_dir: {train} holds a training run (metrics.jsonl, checkpoints, a config.yaml of a "
                           f"program other than eval): program=eval would replace its config.yaml")
    assert f"run_dir={train}-eval" in line
    assert {p: p.read_bytes() for p in train.rglob("*") if p.is_file()} == before  # nothing of it touched
    again = tmp_path / "eval"  # an evaluation's own run directory can take another evaluation
    again.mkdir()
    (again / "config.yaml").write_text("program: eval\n")
    (again / "eval.jsonl").write_text("{}\n")
    check(set_(cfg, program="eval", eval__checkpoint=str(train), run_dir=str(again)))


def test_the_checkpoints_to_evaluate_and_the_summary_line(tmp_path: Path) -> None:
    run = checkpoints(tmp_path / "train", [0, 2, 4])
    assert [c.step for c in checkpoints_to_evaluate(str(run), every=False)] == [4]
    assert [c.step for c in checkpoints_to_evaluate(str(run), every=True)] == [0, 2, 4]
    assert [c.step for c in checkpoints_to_evaluate(str(run / "checkpoints"), every=True)] == [0, 2, 4]
    one = checkpoints_to_evaluate(str(run / "checkpoints" / "step_000002"), every=True)
    assert [c.step for c in one] == [2] and policy_version(one[0]) == 6
    row = {"eval/all/pass@1": 0.25, "eval/all/mean_reward": 0.5, "eval/all/prompts": 40.0, "eval/gsm8k/pass@1": 0.5,
           "eval/math/pass@1": 0.0, "eval/seconds": 1.25}
    assert summary("step_000002", row) == ("eval: step_000002: pass@1 0.250, mean reward 0.500 over 40 prompts; "
                                           "gsm8k pass@1 0.500; math pass@1 0.000 (1.2s)")
