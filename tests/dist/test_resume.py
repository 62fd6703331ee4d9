"""Checkpoint and resume end to end: nothing lost, nothing repeated (local mpiexec, CPU)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from tests.conftest import launch, sglang_env

pytestmark = [pytest.mark.dist, pytest.mark.full]  # the fast tier's bitwise resume: tests/slurm/test_slurm_runtime.py's preempted job
# A format reward gives a non-zero learning signal from the first step at this tiny size, so
# the weights really move and a bitwise comparison means something.
RUN = ["algo.prompts_per_step=8", "algo.samples_per_prompt=4", "data.reward_fn=rlbatch.rewards.rules:format_reward"]


def run(run_dir: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 300):
    return launch([f"run_dir={run_dir}", *RUN, *extra], run_dir.parent, env=env, timeout=timeout)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def export(run_dir: Path, out: Path, role: str = "actor_train") -> bytes:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rlbatch.export", str(run_dir), str(out), "--role", role],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return (out / "model.safetensors").read_bytes()


def role_state(run_dir: Path, role: str) -> dict:
    """A trainable role's tensors in the run's last checkpoint (model and optimizer state)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    out = run_dir / f"{role}.pt"
    dcp_to_torch_save(last / role, out)
    return torch.load(out)


CASES = {
    # (The default run's own 3 + 3 == 6 is the Slurm preemption test's: tests/slurm/test_slurm_runtime.py.
    # The hf engine generates in every case here but vllm's and sglang's.)
    # vLLM: a tensor-parallel worker on both ranks (its sampler draws from the process RNG, seeded
    # per step; the engine's start-up reseeding must not leak into training). head_dim 32 for its
    # CPU attention. Each launch starts vLLM: 50 s to 4.5 min on a loaded 2-core machine, 3-6 min a run.
    "vllm-d1t2": (["roles.actor_infer.backend=vllm:d1t2", "model.num_heads=2", "model.num_kv_heads=1"], 900),
    # PPO: the critic (colocated, fsdp) is checkpointed and resumed with the actor; the first step
    # trains the critic alone (critic warm-up). Seed 2: a reward in every one of the 6 steps, so the
    # critic has a non-zero return to learn, and a gradient to resume, at each (with seed 1 the first
    # three batches score 0).
    "ppo": (["algo=ppo", "algo.critic_warmup_steps=1", "seed=2"], 400),
    # Asynchronous: step s+1 generates (on its own rank) while step s trains; the checkpoint holds
    # the generation made ahead, which the resumed run trains on instead of generating it again.
    # (Run with the reference beside the trainer in the first half of
    # test_async_buffer_saved_with_the_reference_beside_the_trainer_resumes_with_it_on_the_inference_rank.)
    "async": (["roles=disaggregated", "algo.max_staleness=1", "algo.off_policy=tis"], 300),
    # The same with the reference on the inference rank: the checkpoint's generation carries its
    # reference log-probs, taken right after it; 3 + 3 == 6 bitwise.
    "async-reference-rides": (["roles=disaggregated", "roles.reference.device_mapping=[1]", "algo.max_staleness=1",
                               "algo.off_policy=tis"], 300),
    # SGLang generating (its CPU engine, colocated sglang:d2): each generate call reseeds SGLang's
    # scheduler with the step's seed (rlbatch's SGLang plugin), so the resumed run samples what the
    # uninterrupted one did. Each launch starts two engines (~20 s).
    "sglang": (["experiment=arithmetic_sglang"], 900),
    # LoRA: the checkpoint holds the adapters and their AdamW state; the resumed run rebuilds the
    # frozen base from the seed and loads them (the export merges them either way).
    "lora": (["model.lora.rank=16", "model.lora.alpha=32"], 300),
}
ASYNC_KEYS = ("train/staleness", "train/offpolicy/ratio_mean", "train/offpolicy/weight_mean", "train/kl_ref")
KEYS = {"ppo": ("train/critic/value_loss", "train/critic/grad_norm", "critic/explained_variance"),
        "async": ASYNC_KEYS, "async-reference-rides": ASYNC_KEYS}
"""Per-step metrics compared beside the reward, the tokens and the actor's loss and gradient norm."""


@pytest.mark.parametrize("case", [
    pytest.param("vllm-d1t2", marks=pytest.mark.timeout(2700)),
    pytest.param("ppo"), pytest.param("async-reference-rides"), pytest.param("lora"),
    pytest.param("sglang", marks=pytest.mark.timeout(2700))])
def test_three_steps_resume_three_steps_equals_six(run_root: Path, case: str) -> None:
    whole, split, (extra, timeout) = run_root / "whole", run_root / "split", CASES[case]
    env = sglang_env() if case == "sglang" else None
    done = run(whole, "steps=6", *extra, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    first = run(split, "steps=3", *extra, env=env, timeout=timeout)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(split, "steps=6", *extra, env=env, timeout=timeout)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout and "step_000002" in second.stdout
    a, b = rows(whole), rows(split)
    assert [r["step"] for r in b] == list(range(6))
    keys = ("reward_mean", "tokens/generated", "train/pg_loss", "train/grad_norm", *KEYS.get(case, ()))
    assert [[r.get(k) for k in keys] for r in a] == [[r.get(k) for k in keys] for r in b]
    assert any(r.get("train/grad_norm", 0) > 0 for r in a), "the weights must move for this test to mean anything"
    assert export(whole, run_root / "e_whole") == export(split, run_root / "e_split")
    if case.startswith("async"):
        assert [r["train/staleness"] for r in a] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        assert all("train/offpolicy/weight_mean" in r for r in a), "the trainer reads the behaviour log-probs"
        saved = torch_load(split / "checkpoints" / "step_000002" / "rollouts.pt")
        assert [e["step"] for e in saved["entries"]] == [3], "step 3's generation is in the checkpoint"
        assert saved["entries"][0]["rollouts"]["version"] == 2  # made with the policy after 2 updates
        held = {name for fields in saved["entries"][0]["samples"].values() for name in fields}
        assert ("ref_logprobs" in held) == (case == "async-reference-rides"), held
    if case == "lora":
        state = role_state(split, "actor_train")
        weights = [k for k in state if k.startswith("model.")]
        assert weights and all(".lora_" in k for k in weights), weights  # no base weight saved
    if case == "ppo":
        w, s = role_state(whole, "critic"), role_state(split, "critic")
        assert sorted(w) == sorted(s) and any(k.startswith("optim.") for k in w)
        assert all(torch_equal(w[k], s[k]) for k in w), [k for k in w if not torch_equal(w[k], s[k])]
        # The critic exports as a Hugging Face token-classification model, the same bytes either way.
        assert export(whole, run_root / "c_whole", "critic") == export(split, run_root / "c_split", "critic")
        assert all(r["train/critic/grad_norm"] > 0 for r in a), "the critic trains every step"
        # Warm-up: step 0 trains the critic alone (no policy update, nothing to sync), then both.
        assert [r["critic/warmup"] for r in a] == [1.0, 0, 0, 0, 0, 0]
        assert ["train/pg_loss" in r for r in a] == [False, True, True, True, True, True]
        assert ["time/sync" in r for r in a] == [False, True, True, True, True, True]


def test_async_buffer_saved_with_the_reference_beside_the_trainer_resumes_with_it_on_the_inference_rank(
        run_root: Path) -> None:
    """Moving the reference onto the inference rank between two jobs: the buffered generation has
    no reference log-probs, so the resumed run takes them before training on it, and equals a run
    that had the reference there from the start."""
    async_args, rides = CASES["async"][0], CASES["async-reference-rides"][0]
    whole, split = run_root / "whole", run_root / "split"
    for d, steps, extra in ((whole, 6, rides), (split, 3, async_args), (split, 6, rides)):
        done = run(d, f"steps={steps}", *extra)
        assert done.returncode == 0, done.stderr[-3000:]
    keys = ("reward_mean", "tokens/generated", "train/pg_loss", "train/grad_norm", *ASYNC_KEYS)
    assert [[r.get(k) for k in keys] for r in rows(whole)] == [[r.get(k) for k in keys] for r in rows(split)]
    resumed = rows(split)[3]  # trained on the generation restored from the checkpoint
    assert resumed["train/kl_ref"] > 0 and resumed["train/grad_norm"] > 0, resumed


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path)


def torch_equal(x: object, y: object) -> bool:
    import torch

    return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_kill_during_checkpoint_write_keeps_the_previous_one(run_root: Path) -> None:
    d = run_root / "run"
    assert run(d, "steps=2").returncode == 0  # complete checkpoint at step 1
    crashed = run(d, "steps=4", env={"RLBATCH_FAULT": "kill:1:checkpoint"})
    assert crashed.returncode != 0
    ckpts = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert "step_000001" in ckpts and "step_000003" not in ckpts, ckpts
    again = run(d, "steps=4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout and "step_000001 (step 1)" in again.stdout
    assert [r["step"] for r in rows(d)] == [0, 1, 2, 3]


def test_truncated_shard_falls_back_to_the_previous_checkpoint(run_root: Path) -> None:
    d = run_root / "run"
    assert run(d, "steps=4", "save_every=2").returncode == 0  # checkpoints at steps 1 and 3
    shard = sorted((d / "checkpoints" / "step_000003" / "actor_train").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    again = run(d, "steps=5")
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert "step_000003" in out and shard.name in out, "the skipped checkpoint and its bad file are named"
    assert "step_000001 (step 1)" in again.stdout
    assert [r["step"] for r in rows(d)] == [0, 1, 2, 3, 4]


def test_changed_dataset_is_reported(run_root: Path) -> None:
    from rlbatch.data.tokenizer import build_char_tokenizer
    from rlbatch.models.spec import spec_from_config
    from rlbatch.models.tiny import build_tiny_model

    tok = build_char_tokenizer("".join(c for c in string.printable if not c.isspace()))
    spec = spec_from_config({"max_position_embeddings": 256, "initializer_range": 0.1}, vocab=len(tok))
    build_tiny_model(spec, tokenizer=tok).save_pretrained(run_root / "m")
    tok.save_pretrained(run_root / "m")
    data = run_root / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8)))
    d = run_root / "run"
    args = ["experiment=gsm8k", f"model.path={run_root / 'm'}", f"data.path={data}", "algo.prompts_per_step=4",
            "algo.samples_per_prompt=2", "algo.max_new_tokens=4"]
    assert launch([f"run_dir={d}", "steps=1", *args], run_root).returncode == 0
    data.write_text(data.read_text() + json.dumps({"question": "9+9=", "answer": "18"}) + "\n")
    changed = launch([f"run_dir={d}", "steps=2", *args], run_root)
    assert changed.returncode != 0
    assert "dataset changed since this checkpoint" in changed.stdout + changed.stderr


def test_episodes_made_ahead_are_saved_at_a_checkpoint_and_trained_after_resume(run_root: Path) -> None:
    """Multi-turn with max_staleness=1: the checkpoint at the end of step 2 holds step 3's
    trajectories (made ahead, not trained yet) with their loss masks and summaries; the resumed
    run trains step 3 on exactly them (their rewards, turns and token counts), generates nothing
    twice and loses no step."""
    split = run_root / "split"
    args = ["experiment=multiturn", "roles=disaggregated", "algo.max_staleness=1", "algo.off_policy=tis",
            "algo.prompts_per_step=4", "algo.samples_per_prompt=4"]
    first = launch([f"run_dir={split}", *args, "steps=3"], run_root, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    step, episodes = saved_episodes(split / "checkpoints" / "step_000002")
    assert (step, len(episodes)) == (3, 16)
    second = launch([f"run_dir={split}", *args, "steps=5"], run_root, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from" in second.stdout and "step_000002" in second.stdout
    got = rows(split)
    assert [r["step"] for r in got] == list(range(5))
    assert_trained_on_the_saved_episodes(split / "checkpoints" / "step_000002", got)


def saved_episodes(checkpoint: Path) -> tuple[int, list[dict]]:
    """(the step, its trajectories' summaries) a multi-turn checkpoint holds made ahead, each with
    its sample (loss mask included)."""
    [entry] = torch_load(checkpoint / "rollouts.pt")["entries"]
    episodes = entry["rollouts"]["episodes"]
    assert episodes and set(episodes) == set(entry["samples"])
    assert all("loss_mask" in fields for fields in entry["samples"].values())
    return int(entry["step"]), list(episodes.values())


def assert_trained_on_the_saved_episodes(checkpoint: Path, got: list[dict]) -> None:
    """The step a resumed run trained from ``checkpoint``'s trajectories made ahead was scored and
    counted from exactly them."""
    step, eps = saved_episodes(checkpoint)
    resumed = got[step]
    assert resumed["env/reward_mean"] == sum(float(e["reward"]) for e in eps) / len(eps)
    # scored from the saved trajectories (the score phase's mean is float32; another trajectory's
    # reward would move it by a multiple of 1/48)
    assert resumed["reward_mean"] == pytest.approx(resumed["env/reward_mean"], abs=1e-6)
    assert resumed["tokens/generated"] == sum(int(e["generated"]) for e in eps)
    assert resumed["tokens/observed"] == sum(int(e["observed"]) for e in eps)
    assert resumed["train/staleness"] == 1.0 and resumed["train/grad_norm"] > 0
