"""Offload and reload at phase boundaries, and the step's critical path."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from conftest import make_config, make_layout, roles, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import shape_from_config
from rlbatch.plan.predict import predict


def _pred(**over):  # type: ignore[no-untyped-def]
    cfg = make_config(**over)
    return predict(make_layout(cfg), shape_from_config(cfg["model"]), workload_of(cfg), load_hardware("cpu"))


def test_colocated_roles_take_turns_and_move_their_state() -> None:
    p = _pred()
    (g,) = p.gpus
    assert set(g.roles) == {"actor_train", "actor_infer", "reference"}
    train = p.roles["actor_train"].state
    infer = p.roles["actor_infer"].state
    # The sync sends actor_train's gradients and optimizer state to host (it needs only the weights),
    # and generate's start its weights (the sync left them resident).
    assert g.offload_bytes["sync"] == pytest.approx(train["grads"] + train["optimizer"])
    assert g.offload_bytes["generate"] == pytest.approx(train["params"])
    assert g.reload_bytes["generate"] == 0  # its weights came back for the previous step's sync
    assert g.reload_bytes["sync"] == pytest.approx(infer["params"])
    assert g.offload_bytes["ref_logprobs"] == pytest.approx(infer["params"])
    # old_logprobs brings back actor_train's weights; train its gradients and optimizer state.
    assert g.reload_bytes["old_logprobs"] == pytest.approx(train["params"])
    assert g.reload_bytes["train"] == pytest.approx(train["grads"] + train["optimizer"])
    # Every byte that leaves comes back within the step.
    assert sum(g.offload_bytes.values()) == pytest.approx(sum(g.reload_bytes.values()))
    assert p.offload_s > 0 and p.reload_s > 0
    assert p.measured_keys()["time/train"] > p.phase("train").seconds  # type: ignore[union-attr]


def test_one_update_per_step_needs_no_old_logprobs() -> None:
    assert _pred(algo={"mini_batches": 1}).phase("old_logprobs") is None
    assert _pred(algo={"mini_batches": 1, "kl_in_reward": True}).phase("old_logprobs") is not None


def test_offload_off_keeps_everything_resident() -> None:
    rl = {k: {"offload": False} for k in ("actor_train", "actor_infer", "reference")}
    p = _pred(roles=rl)
    (g,) = p.gpus
    assert not any(g.offload_bytes.values()) and not any(g.reload_bytes.values())
    assert "actor_infer" in g.memory["train"]  # still holds its weights and KV cache
    assert p.offload_s == 0 and p.reload_s == 0


def test_disaggregated_inference_never_offloads_and_phases_may_overlap() -> None:
    cfg = make_config(roles=roles("fsdp:d1", "hf:d1", [0], [1]))
    args = (make_layout(cfg), shape_from_config(cfg["model"]), workload_of(cfg), load_hardware("cpu"))
    p = predict(*args)
    infer = next(g for g in p.gpus if g.roles == ("actor_infer",))
    assert not any(infer.offload_bytes.values())
    ph = {t.name: t for t in p.phases}
    # rlbatch's controller: one phase at a time, but the CPU reward scores beside the log-probs.
    assert ph["ref_logprobs"].start == ph["score"].start == pytest.approx(ph["generate"].end)
    assert ph["old_logprobs"].start == pytest.approx(ph["ref_logprobs"].end)
    assert ph["train"].start == pytest.approx(max(ph["old_logprobs"].end, ph["score"].end))
    q = predict(*args, overlap=True)
    assert q.step_s <= p.step_s


def test_the_step_is_the_critical_path_of_its_phases_and_the_controller() -> None:
    p = _pred()
    ph = {t.name: t for t in p.phases}
    chain = [t.total_s for t in p.phases if t.name != "score"]
    assert ph["score"].total_s < ph["ref_logprobs"].total_s + ph["old_logprobs"].total_s  # hidden
    assert p.step_s == pytest.approx(sum(chain) + 5e-3)  # + the step prior


def test_old_logprobs_leave_out_the_first_mini_batch_of_a_single_epoch() -> None:
    base = workload_of(make_config())
    assert base.mini_batches == 2 and base.old_logprob_sequences == base.sequences // 2
    assert replace(base, epochs=2).old_logprob_sequences == base.sequences
    assert replace(base, kl_in_reward=True).old_logprob_sequences == base.sequences


def test_code_sandbox_executes_each_sample_spread_over_its_workers_and_cores() -> None:
    """experiment=code: the execute phase replaces the rule reward (reward role off); 16 x 16
    samples over 2 workers of 2 cores each: 128 executions per worker, 2 at a time, 0.05 s each."""
    from rlbatch.plan import timing

    over = {"data": {"name": "synthetic_code"}, "algo": {"prompts_per_step": 16, "samples_per_prompt": 16},
            "cluster": {"cpus_per_task": 2}, "roles": {"reward": {"enabled": False}, "code_sandbox": {"world_size": 2}}}
    p = _pred(**over)
    assert p.phase("score") is None
    execute = p.phase("execute")
    assert execute is not None and execute.roles == ("code_sandbox",)
    assert execute.features["overhead"] == pytest.approx(128 * timing.SANDBOX_EXEC_CPU_S / 2)
    both = _pred(**(over | {"roles": {"code_sandbox": {"world_size": 2}}}))  # the reward role scores too
    assert both.phase("score") is not None and both.phase("execute") is not None


def test_asynchronous_generation_runs_beside_the_step_and_the_sync_waits_for_it() -> None:
    """max_staleness > 0 on a disaggregated placement: generation starts with the step, every other
    phase starts as if the samples were there, and the sync starts at max(generation, the rest);
    the step is that plus the sync (plus the controller's fixed cost, as synchronously)."""
    cfg = make_config(roles=roles("fsdp:d1", "hf:d1", [0], [1]))
    cfg["algo"]["max_staleness"] = 1
    args = (make_layout(cfg), shape_from_config(cfg["model"]), workload_of(cfg), load_hardware("cpu"))
    p = predict(*args)
    ph = {t.name: t for t in p.phases}
    assert ph["generate"].start == 0 and ph["ref_logprobs"].start == ph["score"].start == 0
    assert ph["old_logprobs"].start == pytest.approx(ph["ref_logprobs"].end)
    rest = max(ph["train"].end, ph["score"].end)
    assert ph["sync"].start == pytest.approx(max(ph["generate"].end, rest))
    sync_ = dict(cfg, algo={**cfg["algo"], "max_staleness": 0})
    s = predict(make_layout(sync_), shape_from_config(sync_["model"]), workload_of(sync_), load_hardware("cpu"))
    fixed = s.step_s - ph_end(s)
    assert p.step_s == pytest.approx(ph["sync"].end + fixed)
    assert p.step_s == pytest.approx(s.step_s - ph["generate"].total_s + max(0.0, ph["generate"].end - rest))
    assert any("max_staleness=1: generation runs beside" in n for n in p.notes)
    colocated = make_config(roles=roles("fsdp:d1", "hf:d1", [0], [0]))
    colocated["algo"]["max_staleness"] = 1
    c = predict(make_layout(colocated), shape_from_config(colocated["model"]), workload_of(colocated),
                load_hardware("cpu"))
    colocated["algo"]["max_staleness"] = 0
    c0 = predict(make_layout(colocated), shape_from_config(colocated["model"]), workload_of(colocated),
                 load_hardware("cpu"))
    assert c.step_s == pytest.approx(c0.step_s) and any("is synchronous" in n for n in c.notes)


def test_a_reference_on_the_inference_gpus_runs_ahead_with_the_generation() -> None:
    """Asynchronously, a reference on actor_infer's GPU takes its log-probs right after the
    generation there; the trainer's phases do not wait for either, the sync waits for both.
    Synchronously the same placement runs them one after the other."""
    cfg = make_config(roles=roles("fsdp:d1", "hf:d1", [0], [1], reference={"device_mapping": [1]}))
    cfg["algo"]["max_staleness"] = 1

    def pred(c: dict) -> Any:
        return predict(make_layout(c), shape_from_config(c["model"]), workload_of(c), load_hardware("cpu"))

    p = pred(cfg)
    ph = {t.name: t for t in p.phases}
    assert ph["generate"].start == 0 and ph["ref_logprobs"].start == pytest.approx(ph["generate"].end)
    assert ph["old_logprobs"].start == 0
    assert ph["train"].start == pytest.approx(max(ph["old_logprobs"].end, ph["score"].end))  # not the reference
    assert ph["sync"].start == pytest.approx(max(ph["ref_logprobs"].end, ph["train"].end, ph["score"].end))
    assert any("the reference's log-probs right after it" in n for n in p.notes)
    s = pred(dict(cfg, algo={**cfg["algo"], "max_staleness": 0}))
    sy = {t.name: t for t in s.phases}
    assert sy["ref_logprobs"].start >= sy["generate"].end and sy["train"].start >= sy["ref_logprobs"].end
    assert p.step_s < s.step_s


def ph_end(p) -> float:  # type: ignore[no-untyped-def]
    return max(t.end for t in p.phases)
