"""Offload and reload at phase boundaries, and the step's critical path."""

from __future__ import annotations

import pytest
from conftest import make_config, make_layout, roles

from rlbatch.plan.hardware import load_hardware
from rlbatch.plan.model import shape_from_config
from rlbatch.plan.predict import predict
from rlbatch.plan.workload import workload_from_config


def _pred(**over):  # type: ignore[no-untyped-def]
    cfg = make_config(**over)
    return predict(make_layout(cfg), shape_from_config(cfg["model"]), workload_from_config(cfg), load_hardware("cpu"))


def test_colocated_roles_take_turns_and_move_their_state() -> None:
    p = _pred()
    (g,) = p.gpus
    assert set(g.roles) == {"actor_train", "actor_infer", "reference"}
    train = p.roles["actor_train"].state
    infer = p.roles["actor_infer"].state
    # The switch at generate's start sends actor_train's whole state to host (sync left it resident).
    assert g.offload_bytes["generate"] == pytest.approx(train["params"] + train["grads"] + train["optimizer"])
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
    args = (make_layout(cfg), shape_from_config(cfg["model"]), workload_from_config(cfg), load_hardware("cpu"))
    p = predict(*args)
    infer = next(g for g in p.gpus if g.roles == ("actor_infer",))
    assert not any(infer.offload_bytes.values())
    ref, reward = p.phase("ref_logprobs"), p.phase("reward")
    assert ref is not None and reward is not None
    assert ref.start == pytest.approx(reward.end)  # rlbatch's controller: one phase at a time
    q = predict(*args, overlap=True)
    ref, reward = q.phase("ref_logprobs"), q.phase("reward")
    assert ref is not None and reward is not None
    # The CPU reward and the reference's log-probs both wait for generate only, and run together.
    assert ref.start == reward.start == pytest.approx(q.phase("generate").end)  # type: ignore[union-attr]
    assert q.step_s < p.step_s


def test_the_step_is_the_sum_of_its_phases_and_the_controller() -> None:
    p = _pred()
    assert p.step_s == pytest.approx(sum(t.total_s for t in p.phases) + 5e-3)  # + the step prior
