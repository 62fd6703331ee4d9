"""Asynchronous off-policy training on a disaggregated placement (``algo.max_staleness``): it
learns with generation a step ahead, the staleness bound holds in every step's record, and an
inference rank killed while it generates ahead ends the job fast, named."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import launch, sglang_env

pytestmark = pytest.mark.dist
ASYNC = ["roles=disaggregated", "algo.max_staleness=1", "algo.off_policy=tis"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_generation_runs_a_step_ahead_within_the_staleness_bound(run_root: Path) -> None:
    """The fast tier's: four steps of the asynchronous run below. Every step after the first trains
    on samples exactly one policy version old, weighed by the truncated importance weights, and each
    step's generation started during the step before it."""
    run = run_root / "run"
    out = launch([*ASYNC, "steps=4", f"run_dir={run}"], run_root)
    assert out.returncode == 0, out.stderr[-3000:]
    r = rows(run)
    assert [x["train/staleness"] for x in r] == [0.0, 1.0, 1.0, 1.0]
    assert all(0 < x["train/offpolicy/weight_mean"] <= 2.0 for x in r)
    assert any(x["train/offpolicy/abs_log_ratio_mean"] > 1e-3 for x in r[1:]), "stale samples differ from the trainer"
    assert all(x["at/generate/start"] < 0 for x in r[1:]), [x["at/generate/start"] for x in r]


@pytest.mark.full
@pytest.mark.timeout(1200)
def test_the_default_experiment_learns_asynchronously(run_root: Path) -> None:
    """From chance to >= 0.8. The seeded run passes 0.8 at step 32 and swings between 0.75 and
    0.87 until 0.92 at step 39, the last of 40 (a shorter run is a prefix of a longer one). Every step after the first trains on samples exactly one
    policy version old, with the truncated importance weights in the record."""
    run = run_root / "run"
    out = launch([*ASYNC, "steps=40", f"run_dir={run}"], run_root, timeout=1100)
    assert out.returncode == 0, out.stderr[-3000:]
    r = rows(run)
    reward = [x["reward_mean"] for x in r]
    assert reward[0] <= 0.2 and reward[-1] >= 0.8, reward
    assert [x["train/staleness"] for x in r] == [0.0] + [1.0] * 39
    assert all(0 < x["train/offpolicy/weight_mean"] <= 2.0 for x in r)
    assert any(x["train/offpolicy/abs_log_ratio_mean"] > 1e-3 for x in r[1:]), "stale samples differ from the trainer"
    # Each step's generation started before the step did (during the previous step's training):
    # its start on the step's wall-clock timeline is negative. Synchronously it is never.
    ahead = [x["at/generate/start"] for x in r[1:]]
    assert all(t < 0 for t in ahead), ahead


@pytest.mark.full
def test_a_reference_on_the_inference_rank_takes_its_log_probs_right_after_each_generation(run_root: Path) -> None:
    """The frozen reference placed on actor_infer's rank rides along: its log-probs of step s+1
    are taken there right after step s+1's generation, while step s trains, so they start before
    the step does. The run is the one with the reference beside the trainer, number for number."""
    runs = {name: run_root / name for name in ("beside_trainer", "on_inference")}
    for name, extra in (("beside_trainer", []), ("on_inference", ["roles.reference.device_mapping=[1]"])):
        out = launch([*ASYNC, *extra, "steps=4", f"run_dir={runs[name]}"], run_root, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "trains synchronously" not in out.stdout
    keys = ("reward_mean", "train/pg_loss", "train/grad_norm", "train/kl_ref", "train/staleness")
    a, b = rows(runs["beside_trainer"]), rows(runs["on_inference"])
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert all(r["train/kl_ref"] > 0 for r in b[1:]), "the KL to the reference is in the loss"
    assert all(r["at/ref_logprobs/start"] < 0 for r in b[1:]), [r["at/ref_logprobs/start"] for r in b]
    assert all(r["at/ref_logprobs/start"] > 0 for r in a), [r["at/ref_logprobs/start"] for r in a]


@pytest.mark.full
def test_an_inference_rank_killed_while_generating_ahead_ends_the_job_fast_and_is_named(run_root: Path) -> None:
    """Rank 1 (actor_infer) dies as it starts its 3rd generation (step 2's, started while step 1
    trains): the job ends well within the control timeout and the report names the rank."""
    start = time.monotonic()
    out = launch([*ASYNC, "steps=6", "cluster.timeout_s=30", f"run_dir={run_root / 'run'}"], run_root,
                 env={"RLBATCH_FAULT": "kill:1:generate:3"}, timeout=300)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    report = out.stderr[out.stderr.find("the run failed"):]
    assert "rank 1 (actor_infer[0]" in report, report[-3000:]
    assert elapsed < 150, f"the job took {elapsed:.0f}s to end"


@pytest.mark.full
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(("backend", "kv"), [("vllm:d1", "keep"), ("sglang:d1", "recompute"), ("vllm:d1t2", "keep"),
                                             ("sglang:d1t2", "keep")],
                         ids=["vllm-keep", "sglang-recompute", "vllm-t2-keep", "sglang-t2-keep"])
def test_weights_land_mid_generation_on_a_rank_of_its_own(run_root: Path, backend: str, kv: str) -> None:
    """``algo.in_flight_updates`` on vLLM's and SGLang's CPU builds: every sync goes through the
    notice and the inference rank's poll (or its sync phase, when the generation ended first), the
    run ends, and the staleness bound by each sample's oldest token holds with nothing dropped. The
    controller does not wait for the inference rank's answer to a sync: it collects it during the
    next step. ``vllm:d1t2``: a worker of two tensor-parallel ranks, which agree on the engine step
    each sync lands at (a disagreement would hang their tensor-parallel collectives or load the
    broadcast into one rank alone). ``sglang:d1t2``: the follower joins each sync while it waits for
    the leader's generations (else the broadcast would wait for it until the generation ends, and
    the leader, paused in it, would never end it)."""
    run = run_root / "run"
    engine, _, dims = backend.partition(":")
    ranks = ["roles.actor_infer.device_mapping=[1,2]"] if dims == "d1t2" else []
    out = launch([*ASYNC, f"roles.actor_infer.backend={backend}", *ranks, "model.num_heads=2", "model.num_kv_heads=1",
                  "algo.in_flight_updates=true", f"algo.in_flight_kv={kv}", "steps=3", f"run_dir={run}"], run_root,
                 env=sglang_env() if engine == "sglang" else None, timeout=1100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = rows(run)
    assert [x["step"] for x in r] == [0, 1, 2]
    assert all(0.0 <= x["train/staleness_min"] <= x["train/staleness"] <= x["train/staleness_max"] <= 1.0 for x in r)
    assert all(x["train/stale_dropped"] == 0.0 and 0.0 <= x["train/mixed_version_frac"] <= 1.0 for x in r)
    # Step s's sync record from the inference rank lands on step s+1's timeline, where it starts
    # before step s+1 trains: the rank runs that sync command when its generation ends, before the
    # data move that step s+1's training follows. A sync the controller waited for would be on
    # step s's own timeline, and every sync record of a step would start after its training.
    assert all(x["at/sync/start"] < x["at/train/start"] for x in r[1:]), [(x["at/sync/start"], x["at/train/start"])
                                                                          for x in r]
    assert r[0]["at/sync/start"] > r[0]["at/train/start"]  # step 0's: the trainer's side alone


@pytest.mark.full
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("infer", [["roles.actor_infer.backend=vllm:d1"],
                                   ["roles.actor_infer.backend=vllm:d1t2", "roles.actor_infer.device_mapping=[1,2]"]],
                         ids=["d1", "d1t2"])
def test_partial_rollouts_carry_unfinished_samples_into_later_steps_with_vllm(run_root: Path, infer: list[str]) -> None:
    """``algo.partial_rollouts`` on vLLM's CPU build: each step trains a full batch of the first
    groups to finish, samples left in flight end in a later step's batch with tokens of several
    policy versions (staleness up to 2, mixed versions), and the bound on the oldest token holds.
    Also on a worker of two tensor-parallel ranks, which keep the same requests and agree on the
    step each sync lands at (a disagreement hangs their collectives): there the run and the bound
    are checked, not how far its slower generation carries samples over (timing)."""
    run = run_root / "run"
    out = launch(["roles=disaggregated", "algo.max_staleness=2", "algo.off_policy=tis",
                  *infer, "model.num_heads=2", "model.num_kv_heads=1",
                  "algo.in_flight_updates=true", "algo.partial_rollouts=true", "steps=4", f"run_dir={run}"],
                 run_root, timeout=1100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = rows(run)
    assert [x["step"] for x in r] == [0, 1, 2, 3]
    assert all(x["samples"] + x["train/stale_dropped"] == r[0]["samples"] for x in r)
    assert all(0.0 <= x["train/staleness_min"] <= x["train/staleness_max"] <= 2.0 for x in r)
    if len(infer) == 1:
        assert max(x["train/staleness_max"] for x in r) == 2.0, "no sample stayed in flight past its step"
        assert any(x["train/mixed_version_frac"] > 0 for x in r[1:]), [x["train/mixed_version_frac"] for x in r]


@pytest.mark.full
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("infer", [["roles.actor_infer.backend=vllm:d1"],
                                   ["roles.actor_infer.backend=vllm:d1t2", "roles.actor_infer.device_mapping=[1,2]"]],
                         ids=["d1", "d1t2"])
def test_partial_rollouts_keep_the_samples_in_flight_in_a_checkpoint_and_train_them_after_resume(
        run_root: Path, infer: list[str]) -> None:
    """A partial-rollouts run on vLLM stopped after 2 steps and resumed to 4: the checkpoint holds the
    samples still generating (each one's prompt, tokens so far, their log-probs and versions), the
    controller's map of them and the next prompts' step; the resumed run puts them back into the
    engine and trains full batches. (Where an in-flight sync lands depends on timing, so two runs
    of partial rollouts with in-flight updates are not the same bit for bit, interrupted or not;
    tests/unit/test_vllm_in_flight_resume.py checks that the engine goes on bitwise from the
    restored state.) ``d1t2``: a worker of two tensor-parallel ranks, each of which takes the
    worker's kept samples back."""
    import torch

    run = run_root / "run"
    args = ["roles=disaggregated", "algo.max_staleness=2", "algo.off_policy=tis", *infer, "model.num_heads=2",
            "model.num_kv_heads=1", "algo.in_flight_updates=true", "algo.partial_rollouts=true", f"run_dir={run}"]
    first = launch([*args, "steps=2"], run_root, timeout=1100)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = torch.load(run / "checkpoints" / "step_000001" / "kept.pt")
    held = [s for w in saved["workers"] for s in w["samples"]]
    assert held and any(s["tokens"] and not s["finished"] for s in held), "no sample was in flight at the checkpoint"
    assert sorted(s["key"] for s in held) == [sid for sid, _ in saved["kept"]], "the map and the engine agree"
    assert all(len(s["tokens"]) == len(s["logprobs"]) == len(s["versions"]) for s in held)
    assert saved["submitted"] == 4  # step 3's prompts went in with step 2's generation, before the checkpoint
    second = launch([*args, "steps=4"], run_root, timeout=1100)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout and "step_000001" in second.stdout
    r = rows(run)
    assert [x["step"] for x in r] == [0, 1, 2, 3]
    assert all(x["samples"] + x["train/stale_dropped"] == r[0]["samples"] for x in r)
    assert all(0.0 <= x["train/staleness_min"] <= x["train/staleness_max"] <= 2.0 for x in r)
