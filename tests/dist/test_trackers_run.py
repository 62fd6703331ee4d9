"""A GSM8K-style run as a user starts it, with held-out evaluation and both trackers, preempted and
resumed: TensorBoard, W&B (offline) and MLflow (file store) hold every step once, the evaluation
at the steps it ran, and one tracker run across the two jobs.

The model is a random-init tiny Qwen2 saved with a ChatML tokenizer, the data the GSM8K sample of
tests/data in verl's parquet layout. The first job is preempted by its deadline (a Slurm end time
closer than ``cluster.deadline_margin_s``: it stops after its first step with a checkpoint, exit
code 3); the second resumes in the same run directory and finishes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, launch
from tests.unit.chat_fixtures import save_chat_model
from tests.unit.wandb_records import offline_runs

pytestmark = [pytest.mark.dist, pytest.mark.full]


def verl_parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (REPO_ROOT / "tests/data/gsm8k_sample.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": r["question"]}],
         "reward_model": {"ground_truth": r["answer"].split("####")[-1].strip()}} for r in rows]), path)
    return path


def test_a_preempted_gsm8k_run_with_evaluation_is_one_run_in_every_tracker(run_root: Path) -> None:
    model, data, run = save_chat_model(run_root / "model"), verl_parquet(run_root / "gsm8k.parquet"), run_root / "run"
    args = ["experiment=gsm8k", f"model.path={model}", f"data.path={data}", "data.chat_template=true",
            '+data.reward_fns={openai/gsm8k: "rlbatch.rewards.math:gsm8k_match"}', f"run_dir={run}", "steps=4",
            "algo.prompts_per_step=4", "algo.samples_per_prompt=2", "algo.max_new_tokens=8",
            "eval.every=2", "eval.data.name=file", f"eval.data.path={data}", "eval.data.chat_template=true",
            "eval.max_prompts=4", "logger=[tensorboard,wandb,mlflow]"]
    out = launch([*args, "cluster.deadline_margin_s=100000"], run_root,
                  env={"SLURM_JOB_END_TIME": str(int(time.time()) + 3600)})
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]  # preempted after step 0
    out = launch(args, run_root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "trackers.wandb: reattached to run" in out.stdout and "trackers.mlflow: reattached to run" in out.stdout

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    evals = {r["step"]: r["eval/all/pass@1"] for r in rows if "eval/all/pass@1" in r}
    assert sorted(evals) == [1, 3]  # after every 2nd step's sync (the last step's included)
    state = json.loads((run / "trackers.json").read_text())

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[int, float] = {}
    for events in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "eval/all/pass@1" in acc.Tags()["scalars"]:
            scalars |= {e.step: e.value for e in acc.Scalars("eval/all/pass@1")}
    assert scalars == pytest.approx(evals)  # float32 in the event file

    wandb = offline_runs(run)  # one directory per job, one id
    assert [r["id"] for r in wandb] == [state["wandb"]["id"]] * 2
    assert [[h["_step"] for h in r["history"]] for r in wandb] == [[0], [1, 2, 3]]
    logged = {h["_step"]: h["eval/all/pass@1"] for r in wandb for h in r["history"] if "eval/all/pass@1" in h}
    assert logged == evals
    assert wandb[0]["config"]["data"]["chat_template"] is True

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run / "mlruns").as_uri())
    run_id = state["mlflow"]["id"]
    assert [r.info.run_id for r in client.search_runs([client.get_experiment_by_name("rlbatch").experiment_id])] == [run_id]
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward_mean")) == [0, 1, 2, 3]
    assert {m.step: m.value for m in client.get_metric_history(run_id, "eval/all/pass_at_1")} == evals
    assert client.get_run(run_id).info.status == "FINISHED"
