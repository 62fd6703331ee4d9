"""What a user sees during a run: sample completions (samples.jsonl, TensorBoard, W&B), a reward
plot whose axes fit the data and that is drawn while the run trains, an environment's failures in
the controller's log, and a kept training batch shown by ``python -m rlbatch.inspect``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from rlbatch.checks.validate import check
from rlbatch.config.schema import WatchConfig
from rlbatch.data.tokenizer import build_char_tokenizer
from rlbatch.inspect import describe, main
from rlbatch.loop.controller import Rollouts
from rlbatch.loop.metrics import CURVE, Metrics, plot_reward
from rlbatch.loop.samples import SAMPLES, EnvFailures, SampleLog, decode_shown, due
from rlbatch.placement.io import save_placement
from rlbatch.runtime.rundir import RunDir
from tests.unit.configs import default_config, problems, set_
from tests.unit.wandb_records import offline_runs

TOK = build_char_tokenizer()


def enc(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"])


def dec(tokens: list[int]) -> str:
    return str(TOK.decode(tokens, skip_special_tokens=False))


def make_run(tmp_path: Path, **overrides: Any) -> Path:
    """A run directory as the launcher leaves it: config.yaml and placement.json."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = set_(default_config(run), steps=6, **overrides)
    save_placement(check(cfg), run / "placement.json")
    OmegaConf.save(OmegaConf.create(cfg), run / "config.yaml")
    return run


def episode(end: str, spans: list[tuple[int, int]], detail: str = "") -> dict[str, Any]:
    return {"reward": 0.5, "turns": len(spans), "end": end, "generated": 2, "observed": 3, "env_seconds": 0.0,
            "tool_calls": {}, "spans": spans, "turn_rewards": [], "worker": None, "detail": detail}


def trajectories(step: int, ends: list[str], detail: str = "") -> Rollouts:
    """Two trajectories of 'step': response '3+5=8' (policy '3', env '+5=', policy '8')."""
    ids = [step * 10 + k for k in range(len(ends))]
    return Rollouts(ids=ids, answers=["8"] * len(ids), group_size=len(ids), prompt_len={i: 2 for i in ids},
                    response_len={i: 5 for i in ids},
                    episodes={i: episode(e, [(0, 1), (4, 1)], detail if e == "error" else "")  # type: ignore[misc]
                              for i, e in zip(ids, ends, strict=True)})


def shown_of(ro: Rollouts) -> dict[int, Any]:
    """What the reward rank sends back for the rollouts (``decode_shown`` over its tokens)."""
    return {sid: decode_shown(dec, enc("2="), enc("3+5=8"), ro.episodes[sid]["spans"]) for sid in ro.ids}


def test_sample_completions_go_to_samples_jsonl_and_tensorboard_once_across_a_resume(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    watch = WatchConfig(samples_every=2, samples_per_step=2)
    assert [s for s in range(6) if due(s, 2, 6)] == [0, 2, 4, 5]  # step 0, every 2nd, the last

    def job(start: int, steps: list[int], crash_mid_line: bool = False) -> None:
        metrics = Metrics(RunDir(run), 6, start)
        log = SampleLog(run, watch, 6, start, metrics)
        for s in steps:
            ro = trajectories(s, ["done", "error"], detail="step raised ValueError: no digit in 'x'")
            assert log.wanted(s) == (2 if due(s, 2, 6) else 0)
            log.record(s, ro, torch.tensor([1.0, 0.0]), torch.tensor([0.7, -0.7]), shown_of(ro) if log.wanted(s) else {})
        if crash_mid_line:
            with open(run / SAMPLES, "a") as f:
                f.write('{"step": 4, "id": 4')
        metrics.close()

    job(0, [0, 1, 2, 3, 4], crash_mid_line=True)  # crashed after step 4's samples, checkpoint after step 2
    job(3, [3, 4, 5])
    rows = [json.loads(line) for line in (run / SAMPLES).read_text().splitlines()]
    assert [(r["step"], r["id"]) for r in rows] == [(0, 0), (0, 1), (2, 20), (2, 21), (4, 40), (4, 41), (5, 50), (5, 51)]
    first, failed = rows[0], rows[1]
    assert (first["prompt"], first["response"], first["answer"]) == ("2=", "3+5=8", "8")
    assert (first["reward"], first["advantage"]) == (1.0, pytest.approx(0.7))
    assert first["turns"] == [{"by": "policy", "text": "3"}, {"by": "env", "text": "+5="},
                              {"by": "policy", "text": "8"}]
    assert (failed["end"], failed["detail"]) == ("error", "step raised ValueError: no digit in 'x'")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts: dict[int, str] = {}
    for events in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
        acc.Reload()
        texts |= {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")}
    assert sorted(texts) == [0, 2, 4, 5]
    assert "3+5=8" in texts[4] and "no digit in 'x'" in texts[4]


def test_a_per_token_advantage_is_shown_as_its_mean_over_the_policy_tokens(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    metrics = Metrics(RunDir(run), 6, 0, tensorboard=False)
    log = SampleLog(run, WatchConfig(samples_every=1, samples_per_step=1), 6, 0, metrics)
    ro = trajectories(0, ["done"])
    log.record(0, ro, torch.tensor([1.0]), [torch.tensor([0.5, 9.0, 9.0, 9.0, 1.5])], shown_of(ro))
    [row] = [json.loads(line) for line in (run / SAMPLES).read_text().splitlines()]
    assert row["advantage"] == pytest.approx(1.0)  # tokens 0 and 4 are the policy's; 1-3 the env's


def test_the_wandb_run_gets_a_samples_table_at_the_steps_shown_in_the_rows_of_those_steps(tmp_path: Path) -> None:
    run = make_run(tmp_path, trackers__wandb__enabled=True)
    metrics = Metrics(RunDir(run), 6, 0, tensorboard=False)
    log = SampleLog(run, WatchConfig(samples_every=2, samples_per_step=2), 6, 0, metrics)
    for s in range(3):
        ro = trajectories(s, ["done", "done"])
        log.record(s, ro, torch.tensor([1.0, 0.0]), torch.tensor([0.7, -0.7]), shown_of(ro) if log.wanted(s) else {})
        metrics.log({"step": s, "reward_mean": 0.5})
    metrics.close()
    [wandb] = offline_runs(run)
    assert [h["_step"] for h in wandb["history"]] == [0, 1, 2]  # one row a step: the table joins its step's row
    tables = {h["_step"]: {k.split("/", 1)[1]: v for k, v in h.items() if k.startswith("samples/")}
              for h in wandb["history"] if "samples/_type" in h}
    assert sorted(tables) == [0, 2]
    assert (tables[0]["_type"], tables[0]["nrows"]) == ("table-file", 2)
    table = json.loads(next((run / "wandb").glob("offline-run-*")).joinpath("files", tables[0]["path"]).read_text())
    assert table["columns"][:4] == ["id", "prompt", "response", "answer"] and table["data"][0][:3] == [0, "2=", "3+5=8"]


def test_the_reward_plot_fits_reward_model_scores_and_negative_shaped_rewards_and_is_drawn_during_the_run(
        tmp_path: Path) -> None:
    rate = [{"step": s, "reward_mean": s / 4} for s in range(5)]
    assert plot_reward(rate, tmp_path / "a.png") == pytest.approx((-0.02, 1.02))  # a pass rate: the unit range
    scores = [{"step": s, "reward_mean": 2.0 + s, "reward_shaped_mean": -1.5 + s} for s in range(5)]
    lo, hi = plot_reward(scores, tmp_path / "b.png")
    assert lo < -1.5 and hi > 6.0  # every point of both curves inside
    assert lo > -2.5 and hi < 7.0  # and no more than a margin around them

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    metrics = Metrics(run, 6, 0, tensorboard=False, plot_every=2)
    metrics.log({"step": 0, "reward_mean": -3.0})
    assert not (run.path / CURVE).exists()
    metrics.log({"step": 1, "reward_mean": 4.0})
    assert (run.path / CURVE).stat().st_size > 1000  # drawn after the 2nd step, not only at the end


def test_an_env_failure_is_logged_once_with_its_words_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    failures = EnvFailures()
    with caplog.at_level(logging.WARNING, logger="rlbatch.loop.samples"):
        for step in range(3):
            failures.observe(step, trajectories(step, ["error", "error", "done"],
                                                detail="step raised KeyError: 'board'").episodes)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "KeyError: 'board'" in lines[0] and "step 0, sample 0" in lines[0]
    summary = failures.summary()
    assert summary is not None and "6 error" in summary and "6x error: step raised KeyError: 'board'" in summary


def test_inspect_shows_a_kept_batch_token_by_token_single_and_multi_turn(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    single = {"id": 7, "reward": 1.0, "answer": "8", "source": "", "prompt": torch.tensor(enc("3+5=")),
              "response": torch.tensor(enc("8<eos>")), "behaviour_logprobs": torch.tensor([-0.25, -0.5]),
              "advantage": torch.tensor(0.75)}
    text = describe({"step": 0, "algo": "grpo", "policy_version": 0, "samples": [single]}, dec, tokens=True)
    assert "sample 7  reward 1  advantage +0.75" in text
    assert "prompt (4 tokens): '3+5='" in text and "response (2 tokens, 2 trained): '8<eos>'" in text
    assert "'8'" in text and "-0.2500" in text and "-0.5000" in text  # the per-token table

    multi = {"id": 3, "reward": 0.5, "answer": "", "source": "", "end": "error", "detail": "step raised ValueError",
             "turns": 2, "prompt": torch.tensor(enc("2=")), "response": torch.tensor(enc("3+5=8")),
             "behaviour_logprobs": torch.tensor([-0.1, 0, 0, 0, -0.2]),
             "loss_mask": torch.tensor([1.0, 0, 0, 0, 1]), "advantages": torch.tensor([0.5, 0, 0, 0, 1.5])}
    run = make_run(tmp_path)
    (run / "batches").mkdir()
    torch.save({"step": 4, "algo": "grpo", "policy_version": 4, "samples": [multi]}, run / "batches" / "step_4.pt")
    assert main([str(run), "--step", "4"]) == 0
    out = capsys.readouterr().out
    assert "end error (2 turns)" in out and "env: step raised ValueError" in out and "advantage +1" in out
    assert "[policy] '3'\n    [env] '+5='\n    [policy] '8'" in out
    assert main([str(run), "--step", "3"]) == 2
    assert "no batch of step 3; kept: 4" in capsys.readouterr().err


def test_watch_settings_out_of_range_are_refused_naming_the_field(tmp_path: Path) -> None:
    found = problems(set_(default_config(tmp_path), watch__samples_per_step=0, watch__samples_every=-1))
    assert any("watch.samples_per_step" in p for p in found) and any("watch.samples_every" in p for p in found)


def test_scoring_asks_the_first_scoring_role_for_the_text_of_the_step_s_first_samples() -> None:
    from rlbatch.loop.scoring import Scoring

    asked: list[tuple[str, list[int]]] = []

    class Role:
        def __init__(self, name: str) -> None:
            self.name = name

        def score(self, ro: Rollouts, show: list[int]) -> Any:
            asked.append((self.name, list(show)))
            return SimpleNamespace(result=lambda: torch.ones(len(ro.ids)), counts={},
                                   shown={i: {"prompt": "", "response": "x", "turns": []} for i in show})

    scoring = Scoring.__new__(Scoring)
    scoring.roles, scoring.pending, scoring.show, scoring.shown = [(Role("reward"), 1.0), (Role("code_sandbox"), 1.0)], [], 2, {}
    scoring.start(trajectories(1, ["done"] * 4))
    scoring.result()
    assert asked == [("reward", [10, 11]), ("code_sandbox", [])] and sorted(scoring.shown) == [10, 11]
