"""The planner with ``model.lora``: the trained policy's gradients and AdamW state are the adapters'."""

from __future__ import annotations

import pytest
from conftest import make_config, make_layout, roles, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.plan.memory import role_memory
from tests.unit.planner.test_plan_packing import Q7B


def _memory(rank: int):  # type: ignore[no-untyped-def]
    cfg = make_config(roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"),
                      model={"lora": {"rank": rank}})
    w = workload_of(cfg, 512, 0.5)
    lay = make_layout(cfg)
    hw = load_hardware("h100_sxm")
    ref = lay.roles.get("reference")
    return role_memory(lay.roles["actor_train"], Q7B, w, 2, hw), None if ref is None else role_memory(ref, Q7B, w, 2, hw)


def test_lora_keeps_the_weights_and_trains_the_adapters() -> None:
    (full, ref_full), (ada, ref_ada) = _memory(0), _memory(16)
    assert ref_full is not None and ref_full.state["params"] > 0
    P, A, n = float(Q7B.params), float(Q7B.adapter_params(16)), 8
    assert ada.state["params"] == full.state["params"] == pytest.approx(4 * P / n)  # fp32 base, frozen
    assert ada.state["adapters"] == pytest.approx(4 * A / n)
    assert ada.state["grads"] == pytest.approx(4 * A / n) and ada.state["optimizer"] == pytest.approx(8 * A / n)
    assert full.state["grads"] == pytest.approx(4 * P / n)
    assert 0.001 < A / P < 0.01  # rank 16 on every linear layer of a 7B: about 0.5%
    held = sum(full.state.values()) - sum(ada.state.values())
    assert held > 11 * P / n  # fp32 gradients and AdamW moments: 12 bytes a parameter, all but the adapters'
    assert full.transient["train"]["fsdp_buffers"] > ada.transient["train"]["fsdp_buffers"]  # no base gradients
    assert ref_ada is None  # the reference is the policy's base model: no copy of its own
    assert any("LoRA rank 16" in note for note in ada.notes)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_with_lora_keeps_gradients_and_adam_state_of_the_adapters_only(stage: int) -> None:
    def memory(rank: int):  # type: ignore[no-untyped-def]
        cfg = make_config(roles=roles("deepspeed:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"),
                          model={"lora": {"rank": rank}})
        cfg["roles"]["actor_train"]["engine_args"] = {"zero_stage": stage}
        return role_memory(make_layout(cfg).roles["actor_train"], Q7B, workload_of(cfg, 512, 0.5), 2,
                           load_hardware("h100_sxm"))

    full, ada = memory(0), memory(16)
    P, A, n = float(Q7B.params), float(Q7B.adapter_params(16)), 8
    assert ada.state["params"] == full.state["params"]  # the frozen base, in the compute dtype
    assert ada.state["optimizer"] == pytest.approx(12 * A / n) and full.state["optimizer"] == pytest.approx(12 * P / n)
    assert ada.state["grads"] / full.state["grads"] == pytest.approx(A / P)
    assert any("LoRA rank 16" in note for note in ada.notes)


def test_lora_training_skips_the_base_weights_gradients() -> None:
    from rlbatch.plan.predict import predict

    def train(rank: int) -> float:
        cfg = make_config(roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"),
                          model={"lora": {"rank": rank}})
        phase = predict(make_layout(cfg), Q7B, workload_of(cfg, 512, 0.5), load_hardware("h100_sxm")).phase("train")
        assert phase is not None
        return phase.features["roofline"]

    full, ada = train(0), train(16)
    # the backward's weight gradients (a third of the FLOPs) and AdamW's pass over the base are gone
    assert 0.3 * full < ada <= (2 / 3) * full * (1 + 1e-9)


@pytest.mark.parametrize("gpus, lora", [(2, 16), (4, 0)])
def test_search_proposes_lora_where_full_fine_tuning_fits_nowhere(gpus: int, lora: int) -> None:
    """A 7B policy: on 2 H100s no placement holds its fp32 weights, gradients and AdamW state with
    vLLM beside it, so the search ranks placements with rank-16 adapters (and says so); on 4 the
    fully trained ones fit and nothing is proposed."""
    from conftest import MODELS

    from rlbatch.plan.coefficients import Coefficients
    from rlbatch.plan.search import search

    cfg = make_config(model={"path": str(MODELS / "qwen2_5_7b")},
                      algo={"max_new_tokens": 512, "prompts_per_step": 8, "samples_per_prompt": 4},
                      roles=roles("fsdp:d1", "vllm:d1", "list(range(0,1))", "list(range(0,1))", max_tokens=None))
    best, stats = search(cfg, gpus, 8, Q7B, workload_of(cfg, 256, 0.5), load_hardware("h100_sxm"),
                         Coefficients(), "auto", top=3)
    assert best and stats["lora"] == lora and stats["invalid"] == 0
    assert all(c.lora == lora for c in best)
    assert all(("++model.lora.rank=16" in c.overrides) == bool(lora) for c in best)
    # with adapters the reference is the policy's base: not placed, and the command says so
    assert all(("reference" in c.layout.roles) != bool(lora) for c in best)
    assert all(("roles.reference.enabled=false" in c.overrides) == bool(lora) for c in best)


def test_with_lora_the_reference_phase_runs_on_the_policys_base() -> None:
    """No reference role: its log-probs are a forward of actor_train with the adapters off, timed
    as a log-prob pass of actor_train; a configured reference role adds nothing (it is not placed)."""
    from rlbatch.plan.predict import predict
    from rlbatch.plan.schedule import planned_phases

    cfg = make_config(roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"),
                      model={"lora": {"rank": 16}})
    lay, w = make_layout(cfg), workload_of(cfg, 512, 0.5)
    assert "reference" in cfg["roles"] and "reference" not in lay.roles and w.kl
    by_name = {p.name: p for p in planned_phases(lay, w)}
    assert "ref_logprobs" not in by_name and by_name["base_logprobs"].active == {"actor_train": ("params",)}
    pred = predict(lay, Q7B, w, load_hardware("h100_sxm"))
    base, old = pred.phase("base_logprobs"), pred.phase("old_logprobs")
    assert base is not None and old is not None  # the same forward of actor_train, adapters off or on
    assert base.seconds == pytest.approx(old.seconds, rel=0.01) and base.seconds > 0


@pytest.mark.parametrize("sync, smaller", [("auto", True), ("merged", False)])
def test_an_adapter_sync_into_vllm_moves_the_adapters_alone(sync: str, smaller: bool) -> None:
    """With adapters synced alone (vLLM loads them; ``model.lora.sync`` auto) the sync phase moves
    r x (in + out) per adapted layer instead of every weight; merged moves what full fine-tuning does."""
    from rlbatch.plan.predict import predict

    def seconds(rank: int) -> float:
        cfg = make_config(roles=roles("fsdp:d4", "vllm:d4", "list(range(0,4))", "list(range(4,8))"),
                          model={"lora": {"rank": rank, "sync": sync}})
        phase = predict(make_layout(cfg), Q7B, workload_of(cfg, 512, 0.5), load_hardware("h100_sxm")).phase("sync")
        assert phase is not None
        return phase.seconds

    full, ada = seconds(0), seconds(16)
    # ~200x fewer bytes; the per-sync fixed cost and collective latencies stay
    assert (ada < full / 4) == smaller and (ada == pytest.approx(full)) != smaller
    assert Q7B.adapted_layers() == 7 * Q7B.layers  # q, k, v, o, gate, up, down
