"""Experiment trackers (``rlbatch.trackers``): W&B offline and an MLflow file store receive each
step's metrics row, one tracker run across the jobs of a run, no step twice; a failing tracker
never stops training; a bad ``trackers`` section is refused before start.

The jobs are driven through ``Metrics`` (the controller's metrics, which owns the trackers), as the
training loop drives it: a fresh one per job, ``start`` the step the job resumes at.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from rlbatch.checks.validate import check
from rlbatch.config.tracker_shapes import TRACKER_NAMES
from rlbatch.loop.metrics import Metrics
from rlbatch.placement.io import save_placement
from rlbatch.runtime.rundir import RunDir
from rlbatch.trackers.base import TrackerSpec
from rlbatch.trackers.registry import TRACKERS
from rlbatch.trackers.session import STATE
from tests.unit.configs import default_config, problems, set_
from tests.unit.wandb_records import offline_runs

STEPS = 6


def make_run(tmp_path: Path, **overrides: Any) -> Path:
    """A run directory as the launcher leaves it: config.yaml and placement.json."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = set_(default_config(run), steps=STEPS, **overrides)
    save_placement(check(cfg), run / "placement.json")
    OmegaConf.save(OmegaConf.create(cfg), run / "config.yaml")
    return run


def row(step: int) -> dict[str, Any]:
    return {"step": step, "reward_mean": step / 8, "time/step": 1.0 + step, "eval/all/pass@1": step / 16,
            "eval/all/mean_reward": step / 12, "eval/updates": step + 1, "experiment": "not a number"}


def job(run: Path, start: int, steps: list[int]) -> None:
    """One job of the run: resumes at ``start`` and logs ``steps`` (a crashed job's re-run included)."""
    m = Metrics(RunDir(run), STEPS, start)
    for s in steps:
        m.log(row(s))
    m.close()


def three_jobs(run: Path) -> None:
    """Preempted after step 2; requeued, preempted after step 4, which it logged but did not
    checkpoint (it crashed); resumed from step 3's checkpoint: steps 4 and 5."""
    job(run, 0, [0, 1, 2])
    job(run, 3, [3, 4])
    job(run, 4, [4, 5])


def test_wandb_offline_is_one_run_across_jobs_with_every_step_once(tmp_path: Path) -> None:
    run = make_run(tmp_path, trackers__wandb__enabled=True, trackers__wandb__tags=["grpo"],
                   cluster__env={"HF_TOKEN": "hf_secret"})
    three_jobs(run)
    state = json.loads((run / STATE).read_text())
    runs = offline_runs(run)
    assert [r["id"] for r in runs] == [state["wandb"]["id"]] * 3  # one run id, one offline directory per job
    steps = [[h["_step"] for h in r["history"]] for r in runs]
    assert steps == [[0, 1, 2], [3, 4], [5]]  # the re-run step 4 is not logged twice
    for r in runs:
        for h in r["history"]:
            want = row(h["_step"])
            assert (h["reward_mean"], h["time/step"], h["eval/all/pass@1"]) == (
                want["reward_mean"], want["time/step"], want["eval/all/pass@1"])
            assert "experiment" not in h
    config = runs[0]["config"]
    assert config["steps"] == STEPS and config["trackers"]["wandb"]["tags"] == ["grpo"]
    assert config["cluster"]["env"] == {"HF_TOKEN": "<hidden>"}  # a credential never leaves the run directory
    assert config["placement"]["roles"]["actor_train"] == {
        "backend": "fsdp:d2", "gpu_ranks": "0-1", "workers": 2, "nodes": "0", "colocated_with": "actor_infer,reference"}
    assert state["wandb"]["last_step"] == 5


def mlflow_client(store: Path) -> Any:
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(store.as_uri())


def test_mlflow_file_store_is_one_run_across_jobs_with_every_step_once(tmp_path: Path) -> None:
    run = make_run(tmp_path, trackers__mlflow__enabled=True, trackers__mlflow__experiment="gsm8k",
                   cluster__env={"HF_TOKEN": "hf_secret"})
    job(run, 0, [0, 1, 2])
    client = mlflow_client(run / "mlruns")
    run_id = json.loads((run / STATE).read_text())["mlflow"]["id"]
    assert client.get_run(run_id).info.status == "KILLED"  # stopped before its last step
    job(run, 3, [3, 4])
    job(run, 4, [4, 5])
    exp = client.get_experiment_by_name("gsm8k")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [run_id]
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    for key, mlflow_key in (("reward_mean", "reward_mean"), ("eval/all/pass@1", "eval/all/pass_at_1")):
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, mlflow_key))
        assert hist == [(s, row(s)[key]) for s in range(STEPS)]
    params = got.data.params
    assert params["cluster.env.HF_TOKEN"] == "<hidden>" and "hf_secret" not in json.dumps(params)
    assert params["steps"] == str(STEPS) and params["algo.name"] == "grpo"
    assert params["placement.roles.actor_infer.backend"] == "hf:d2" and params["placement.num_gpus"] == "2"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_mlflow_server_that_is_down_warns_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run = make_run(tmp_path, trackers__mlflow__enabled=True,
                   trackers__mlflow__tracking_uri=f"http://127.0.0.1:{closed_port()}")
    with caplog.at_level(logging.WARNING, logger="rlbatch.trackers"):
        job(run, 0, [0, 1, 2])
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trackers.mlflow")]
    assert warned[0].startswith("trackers.mlflow: ") and "training goes on" in warned[0]
    assert any("still failing since step 0: its rows from step 0 on are in metrics.jsonl only" in w for w in warned)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


@dataclasses.dataclass
class FlakySettings:
    enabled: bool = False


class FlakyTracker:
    """Fails every call while ``down`` is set; records what it was given."""

    down = False
    tries: list[int] = []
    logged: list[int] = []

    def __init__(self, settings: Mapping[str, Any], run_dir: Path) -> None:
        pass

    def start(self, run_id: str | None, params: Mapping[str, Any]) -> str:
        return run_id or "flaky-1"

    def log(self, step: int, values: Mapping[str, float]) -> None:
        FlakyTracker.tries.append(step)
        if FlakyTracker.down:
            raise ConnectionError("server down")
        FlakyTracker.logged.append(step)

    def where(self) -> str:
        return "here"

    def finish(self, completed: bool) -> None:
        pass


def test_a_failing_tracker_is_retried_with_backoff_and_caught_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(TRACKERS, "flaky", TrackerSpec("flaky", f"{__name__}:FlakyTracker",
                                                       lambda t: FlakySettings(enabled=True), lambda s: [],
                                                       package="json", install="-"))
    monkeypatch.setattr(FlakyTracker, "tries", [])
    monkeypatch.setattr(FlakyTracker, "logged", [])
    run = make_run(tmp_path)
    m = Metrics(RunDir(run), 12, 0)
    with caplog.at_level(logging.WARNING, logger="rlbatch.trackers"):
        for s in range(12):
            FlakyTracker.down = 1 <= s <= 5
            m.log(row(s))
    m.close()
    # Down at steps 1-5: it fails on step 1's row at step 1, and is tried again 1, 2 and 4 steps
    # later (steps 2, 4, 8: each try fails on the oldest row it lacks, step 1's); not at 3, 5, 6, 7.
    # At step 8 it answers and is given steps 1-8, then each step's row.
    assert FlakyTracker.tries == [0, 1, 1, 1, *range(1, 12)]
    assert FlakyTracker.logged == list(range(12))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "server down" in warned[0] and "answering again at step 8" in warned[1]


def test_bad_tracker_settings_are_refused_naming_the_field(cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    bad = set_(cfg, trackers__wandb__enabled=True, trackers__wandb__mode="cloud", trackers__wandb__project="a/b",
               trackers__wandb__tags=["x" * 65], trackers__mlflow__enabled=True,
               trackers__mlflow__tracking_uri="sqlite:///runs.db", trackers__mlflow__experiment="")
    assert problems(bad) == [
        "trackers.wandb.mode: 'cloud' is not one of ['offline', 'online']",
        "trackers.wandb.project: 'a/b' holds '/'; W&B names may not contain / \\ # ? % :",
        f"trackers.wandb.tags[0]: expected a string of 1 to 64 characters, got '{'x' * 65}'",
        "trackers.mlflow.tracking_uri: scheme 'sqlite' of 'sqlite:///runs.db' is not supported by the MLflow client "
        "rlbatch installs (mlflow-skinny: file stores and servers); use a path, a 'file:' URI or an 'http(s)://' "
        "server (a server may keep its runs in any database)",
        "trackers.mlflow.experiment: expected a non-empty string, got ''",
    ]
    assert problems(set_(cfg, trackers__mlflow__tracking_uri="http:///x", trackers__wandb__enabled="yes")) == [
        "trackers.wandb.enabled: expected true or false, got 'yes'",
        "trackers.mlflow.tracking_uri: 'http:///x' names no host; expected 'http(s)://host:port'"]
    assert problems(set_(cfg, trackers__neptune={"enabled": True}, trackers__wandb__projekt="x")) == [
        "trackers: unknown tracker(s) ['neptune']; this build has ['mlflow', 'wandb']",
        "trackers.wandb: unknown field(s) ['projekt']; known fields: ['enabled', 'entity', 'mode', 'name', 'project', "
        "'tags']"]
    monkeypatch.setitem(TRACKERS, "wandb", dataclasses.replace(TRACKERS["wandb"], package="rlbatch_no_such_package"))
    on = set_(cfg, trackers__wandb__enabled=True)
    assert problems(on) == ["trackers.wandb.enabled: the 'rlbatch_no_such_package' package is not installed here; "
                            "pip install 'rlbatch[trackers]' (or: pip install wandb)"]
    check(on, runnable=False)  # the planner does not judge this machine's packages


def test_the_registry_has_a_tracker_for_each_section_of_the_schema() -> None:
    """The parse knows the trackers by ``TrackersConfig``'s sections; the session by the registry."""
    assert list(TRACKERS) == list(TRACKER_NAMES)


def test_an_mlflow_file_store_under_a_file_is_refused_naming_the_path(cfg: dict[str, Any]) -> None:
    """mkdir would fail at the run's start: the store's path, or a directory above it, is a regular
    file (an absolute path, a 'file:' URI, or a relative one, under run_dir)."""
    run_dir = Path(cfg["run_dir"])
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("not a directory")
    on = set_(cfg, trackers__mlflow__enabled=True)
    notes = run_dir / "notes.txt"
    for uri, store, above in (("/etc/passwd/mlruns", "/etc/passwd/mlruns", "/etc/passwd"),
                              (f"file://{notes}/a/mlruns", f"{notes}/a/mlruns", f"{notes}"),
                              ("notes.txt/mlruns", f"{notes}/mlruns", f"{notes}")):
        assert problems(set_(on, trackers__mlflow__tracking_uri=uri)) == [
            f"trackers.mlflow.tracking_uri: {uri!r}: the file store {store} lies under {above}, a file, not a directory"]
    assert problems(set_(on, trackers__mlflow__tracking_uri="notes.txt")) == [
        f"trackers.mlflow.tracking_uri: 'notes.txt': the file store {run_dir}/notes.txt is a file, not a directory"]
    (run_dir / "mlruns").write_text("")
    assert problems(on) == [f"trackers.mlflow.tracking_uri: unset ({run_dir}/mlruns): the file store {run_dir}/mlruns "
                            f"is a file, not a directory"]
    check(set_(on, trackers__mlflow__tracking_uri="store/mlruns"))  # created under run_dir at the start
    check(on, runnable=False)  # the planner does not judge this machine's filesystem
    check(set_(cfg, trackers__mlflow__tracking_uri="/etc/passwd/mlruns"))  # not enabled: no store is made


def test_a_tracker_whose_run_is_gone_starts_a_new_one_with_every_row(tmp_path: Path) -> None:
    """The store moved between jobs (trackers.mlflow.tracking_uri changed): the recorded run is not
    in the new one, so the job starts a run there and gives it the rows kept before the checkpoint."""
    run = make_run(tmp_path, trackers__mlflow__enabled=True, trackers__mlflow__tracking_uri="first")
    job(run, 0, [0, 1, 2])
    first_id = json.loads((run / STATE).read_text())["mlflow"]["id"]
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.trackers.mlflow.tracking_uri = "second"
    OmegaConf.save(cfg, run / "config.yaml")
    job(run, 3, [3, 4, 5])
    second_id = json.loads((run / STATE).read_text())["mlflow"]["id"]
    assert second_id != first_id
    second = mlflow_client(run / "second")
    assert sorted(m.step for m in second.get_metric_history(second_id, "reward_mean")) == list(range(STEPS))
    assert sorted(m.step for m in mlflow_client(run / "first").get_metric_history(first_id, "reward_mean")) == [0, 1, 2]


def test_logger_names_the_trackers_and_tensorboard(tmp_path: Path, cfg: dict[str, Any],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``logger=[tensorboard,wandb,mlflow]`` turns the trackers on as their ``enabled`` does (their
    settings still under ``trackers``); without 'tensorboard' no event files are written."""
    run = make_run(tmp_path, logger=["wandb", "mlflow"])
    m = Metrics(RunDir(run), STEPS, 0, tensorboard=False)
    m.log(row(0))
    m.close()
    assert [[h["_step"] for h in r["history"]] for r in offline_runs(run)] == [[0]]
    assert mlflow_client(run / "mlruns").search_experiments() and json.loads((run / STATE).read_text()).keys() == {
        "wandb", "mlflow"}
    assert not (run / "tensorboard").exists()
    assert problems(set_(cfg, logger=["tensorboard", "neptune"])) == [
        "logger: unknown ['neptune']; this build logs to ['tensorboard', 'wandb', 'mlflow']"]
    assert problems(set_(cfg, logger="wandb"))[0].startswith("logger: expected a list of names")
    monkeypatch.setitem(TRACKERS, "wandb", dataclasses.replace(TRACKERS["wandb"], package="rlbatch_no_such_package"))
    assert problems(set_(cfg, logger=["tensorboard", "wandb"])) == [
        "logger: wandb: the 'rlbatch_no_such_package' package is not installed here; pip install 'rlbatch[trackers]' "
        "(or: pip install wandb)"]
