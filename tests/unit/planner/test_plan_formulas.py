"""Published memory formulas against the figures their sources print, and the planner against them."""

from __future__ import annotations

import pytest
from conftest import MODELS, make_config, make_layout, roles, workload_of

from rlbatch.models.shape import ModelShape, shape_from_config
from rlbatch.plan import activations as act
from rlbatch.plan.formulas import (
    deepspeed_zero3_estimate,
    korthikanti_layer_bytes,
    megatron_weight_optimizer_bytes,
    zero_model_states_bytes,
)
from rlbatch.plan.memory import role_memory

GiB = 2**30


def test_zero_paper_figure_1() -> None:
    # ZeRO (arXiv:1910.02054) Fig. 1: Psi = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB per GPU.
    psi = 7.5e9
    got = [zero_model_states_bytes(psi, stage, 64) / 1e9 for stage in range(4)]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.9], abs=0.06)
    assert zero_model_states_bytes(psi, 0, 1) == 16 * psi  # 16 bytes per parameter, mixed-precision Adam


@pytest.mark.parametrize(("gpus", "optimizer", "params", "printed_gpu", "printed_cpu"), [
    # Hugging Face DeepSpeed docs, "Memory requirements": bigscience/T0_3B, "Model with 2783M total
    # params, 65M largest layer params", 1 node, zero_init=1, in GiB:
    (1, False, False, 46.91, 0.37),   # offload_param=none, offload_optimizer=none
    (1, True, False, 5.43, 62.23),    # offload_param=none, offload_optimizer=cpu
    (1, True, True, 0.25, 70.00),     # offload_param=cpu,  offload_optimizer=cpu
    (2, False, False, 23.58, 0.74),   # the same for 2 GPUs per node
    (2, True, False, 2.84, 62.23),
])
def test_deepspeed_zero3_estimate_reproduces_the_printed_table(
    gpus: int, optimizer: bool, params: bool, printed_gpu: float, printed_cpu: float
) -> None:
    # The printout truncates the counts to whole millions, so the true counts lie in
    # [2783M, 2784M) and [65M, 66M): the printed values must fall between the two bounds.
    lo = deepspeed_zero3_estimate(2783e6, 65e6, gpus, 1, optimizer, params)
    hi = deepspeed_zero3_estimate(2784e6, 66e6, gpus, 1, optimizer, params)
    assert lo.gpu_bytes / GiB - 0.005 <= printed_gpu <= hi.gpu_bytes / GiB + 0.005
    assert lo.cpu_bytes / GiB - 0.005 <= printed_cpu <= hi.cpu_bytes / GiB + 0.005


def test_planner_deepspeed_zero3_matches_deepspeeds_gpu_estimate(h100) -> None:  # type: ignore[no-untyped-def]
    shape = shape_from_config({"path": str(MODELS / "llama2_7b")})
    cfg = make_config(roles=roles("deepspeed:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    layout = make_layout(cfg)
    m = role_memory(layout.roles["actor_train"], shape, workload_of(cfg), 2, h100)
    ds = deepspeed_zero3_estimate(shape.params, shape.largest_module_params, 8, 1)
    gather = m.transient["train"]["gather_buffers"]
    assert sum(m.state.values()) + gather == pytest.approx(ds.gpu_bytes, abs=8)


@pytest.mark.parametrize(("offload_optimizer", "offload_params"), [(True, False), (True, True)])
def test_planner_deepspeed_zero3_offload_matches_deepspeeds_gpu_estimate(h100, offload_optimizer: bool,  # type: ignore[no-untyped-def]
                                                                         offload_params: bool) -> None:
    shape = shape_from_config({"path": str(MODELS / "llama2_7b")})
    cfg = make_config(roles=roles("deepspeed:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    cfg["roles"]["actor_train"]["engine_args"] = {"zero_stage": 3, "offload_optimizer": offload_optimizer,
                                                  "offload_params": offload_params}
    m = role_memory(make_layout(cfg).roles["actor_train"], shape, workload_of(cfg), 2, h100)
    ds = deepspeed_zero3_estimate(shape.params, shape.largest_module_params, 8, 1, offload_optimizer, offload_params)
    # By hand: 4 bytes per largest-layer parameter, plus the 2-byte weight shards unless they are offloaded too.
    by_hand = 4 * shape.largest_module_params + (0 if offload_params else int(2 * shape.params / 8))
    assert ds.gpu_bytes == by_hand
    assert sum(m.state.values()) + m.transient["train"]["gather_buffers"] == pytest.approx(by_hand, abs=8)


def test_planner_megatron_matches_megatrons_theoretical_memory(h100) -> None:  # type: ignore[no-untyped-def]
    # megatron/training/theoretical_memory_usage.py, compute_weight_and_optimizer_memory, written
    # out for Llama-2-7B (RMSNorm: norm_size 1, SwiGLU: 3/2, no GQA) at tp=2, pp=2, dp=4 with the
    # distributed optimizer: 6 + 12/dp bytes per parameter of the most loaded shard.
    h, f, L, V = 4096, 11008, 32, 32000
    layer = 2 * h * (f * 3 / 2 + 1) + 2 * h * h * ((1 + 32 / 32) * 1.0)
    block = layer * L + h  # + final layernorm
    shard = (block / 2 + h * V) / 2
    expected = shard * (6 + 12 / 4)
    assert megatron_weight_optimizer_bytes(block, h * V, True, 2, 2, 4, True) == pytest.approx(expected)

    shape = shape_from_config({"path": str(MODELS / "llama2_7b")})
    distributed = {"actor_train": {"engine_args": {"distributed_optimizer": True}}}
    cfg = make_config(roles=roles("megatron:d4p2t2", "vllm:d4t4", "list(range(0,16))", "list(range(0,16))",
                                  **distributed))
    m = role_memory(make_layout(cfg).roles["actor_train"], shape, workload_of(cfg), 2, h100)
    assert sum(m.state.values()) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("d", [1, 2, 4])
def test_megatron_distributed_optimizer_divides_the_optimizer_state_by_d(h100, d: int) -> None:  # type: ignore[no-untyped-def]
    # Llama-2-7B at p2t2: the most loaded shard holds (block / 2 + h * V) / 2 parameters (untied, pp > 1:
    # the output layer sits on the last stage). engine_args.distributed_optimizer: bf16 weights (2 bytes),
    # fp32 gradient buffers (4) and the fp32 main weight + two AdamW moments (12) of 1/d of them.
    # Off (the default): the same 4 + 12 bytes on every rank (the engine's fp32 main weights).
    h, f, L, V = 4096, 11008, 32, 32000
    block = (2 * h * (f * 3 / 2 + 1) + 2 * h * h * 2) * L + h
    shard = (block / 2 + h * V) / 2
    shape = shape_from_config({"path": str(MODELS / "llama2_7b")})
    state = {}
    for on in (True, False):
        extra = {"actor_train": {"engine_args": {"distributed_optimizer": on}}}
        cfg = make_config(roles=roles(f"megatron:d{d}p2t2", f"vllm:d{d}t4", f"list(range(0,{4 * d}))",
                                      f"list(range(0,{4 * d}))", **extra))
        state[on] = role_memory(make_layout(cfg).roles["actor_train"], shape, workload_of(cfg), 2, h100).state
    assert state[True] == pytest.approx({"params": 2 * shard, "grads": 4 * shard, "optimizer": 12 * shard / d}, rel=1e-9)
    assert state[False] == pytest.approx({"params": 2 * shard, "grads": 4 * shard, "optimizer": 12 * shard}, rel=1e-9)


GPT3 = ModelShape(layers=96, hidden=12288, heads=96, kv_heads=96, head_dim=128, ffn=4 * 12288, vocab=51200,
                  gated=False, name="gpt3-175b")


def test_korthikanti_closed_form_by_hand() -> None:
    # Korthikanti et al. 2022, Sec. 4: s*b*h*(34 + 5*a*s/h) per layer. GPT-3 175B at s=2048, b=1:
    # 2048 * 12288 * (34 + 5*96*2048/12288) = 2048 * 12288 * 114 bytes.
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, recompute="full") == 2 * 2048 * 12288


@pytest.mark.parametrize(("t", "sp", "recompute"), [
    (1, True, "none"), (8, True, "none"), (8, False, "none"), (8, True, "selective"), (8, False, "selective"),
    (1, True, "full"),
])
def test_generalised_layer_count_reduces_to_table_2(t: int, sp: bool, recompute: str) -> None:
    s, b = 2048, 1
    paper = korthikanti_layer_bytes(s, b, GPT3.hidden, GPT3.heads, t, sp, recompute)
    ours = act.layer_bytes(GPT3, s, b, e=2, t=t, sp=sp, flash=False, dropout=True, recompute=recompute)
    assert ours == pytest.approx(paper)


def test_flash_attention_and_no_dropout_drop_the_quadratic_term() -> None:
    short = act.layer_bytes(GPT3, 1024, 1)
    long = act.layer_bytes(GPT3, 2048, 1)
    assert long == pytest.approx(2 * short)  # linear in s once no s^2 score matrix is kept
