"""The planner with ``model.lora``: the trained policy's gradients and AdamW state are the adapters'."""

from __future__ import annotations

import pytest
from conftest import make_config, make_layout, roles

from rlbatch.plan.hardware import load_hardware
from rlbatch.plan.memory import role_memory
from rlbatch.plan.workload import workload_from_config
from tests.unit.planner.test_plan_packing import Q7B


def _memory(rank: int):  # type: ignore[no-untyped-def]
    cfg = make_config(roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"),
                      model={"lora": {"rank": rank}})
    w = workload_from_config(cfg, 512, 0.5)
    lay = make_layout(cfg)
    hw = load_hardware("h100_sxm")
    return role_memory(lay.roles["actor_train"], Q7B, w, 2, hw), role_memory(lay.roles["reference"], Q7B, w, 2, hw)


def test_lora_keeps_the_weights_and_trains_the_adapters() -> None:
    (full, ref_full), (ada, ref_ada) = _memory(0), _memory(16)
    P, A, n = float(Q7B.params), float(Q7B.adapter_params(16)), 8
    assert ada.state["params"] == full.state["params"] == pytest.approx(4 * P / n)  # fp32 base, frozen
    assert ada.state["adapters"] == pytest.approx(4 * A / n)
    assert ada.state["grads"] == pytest.approx(4 * A / n) and ada.state["optimizer"] == pytest.approx(8 * A / n)
    assert full.state["grads"] == pytest.approx(4 * P / n)
    assert 0.001 < A / P < 0.01  # rank 16 on every linear layer of a 7B: about 0.5%
    held = sum(full.state.values()) - sum(ada.state.values())
    assert held > 11 * P / n  # fp32 gradients and AdamW moments: 12 bytes a parameter, all but the adapters'
    assert full.transient["train"]["fsdp_buffers"] > ada.transient["train"]["fsdp_buffers"]  # no base gradients
    assert ref_ada.state == ref_full.state and ref_ada.transient == ref_full.transient  # the base model either way
    assert any("LoRA rank 16" in note for note in ada.notes)


def test_lora_training_skips_the_base_weights_gradients() -> None:
    from rlbatch.plan.predict import predict

    def train(rank: int) -> float:
        cfg = make_config(roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"),
                          model={"lora": {"rank": rank}})
        phase = predict(make_layout(cfg), Q7B, workload_from_config(cfg, 512, 0.5), load_hardware("h100_sxm")).phase("train")
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
    best, stats = search(cfg, gpus, 8, Q7B, workload_from_config(cfg, 256, 0.5), load_hardware("h100_sxm"),
                         Coefficients(), "auto", top=3)
    assert best and stats["lora"] == lora and stats["invalid"] == 0
    assert all(c.lora == lora for c in best)
    assert all(("++model.lora.rank=16" in c.overrides) == bool(lora) for c in best)
