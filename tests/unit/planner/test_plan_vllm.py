"""vLLM's memory and generation model (rlbatch/engines/vllm/cost.py), by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import MODELS, make_config, make_layout, roles, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.engines.vllm.cost import decode_batches, tokens_per_sequence
from rlbatch.models.shape import shape_from_config
from rlbatch.plan.coefficients import Coefficients
from rlbatch.plan.memory import role_memory
from rlbatch.plan.predict import predict
from rlbatch.plan.search import infer_dims, search

TINY = {"num_heads": 2, "num_kv_heads": 1}  # head_dim 32, as vLLM's CPU attention needs


def _cpu_memory(kv_cache_mb: int | None):  # type: ignore[no-untyped-def]
    args = {"engine_args": {"kv_cache_mb": kv_cache_mb}} if kv_cache_mb is not None else {}
    cfg = make_config(model=TINY, cluster={"device": "cpu"}, roles=roles("fsdp:d2", "vllm:d2", [0, 1], [0, 1], actor_infer=args))
    w = workload_of(cfg)
    return role_memory(make_layout(cfg).roles["actor_infer"], shape_from_config(cfg["model"]), w, 4, load_hardware("cpu")), w


def test_cpu_kv_cache_is_kv_cache_mb_or_the_default_and_bounds_the_batch() -> None:
    m, w = _cpu_memory(1)
    assert (w.sequences, w.prompt_len, w.response_max, w.samples_per_prompt) == (128, 5, 8, 8)
    # 2 layers x (K, V) x 1 KV head x head_dim 32 x 4 bytes = 512 bytes a token; a sequence of
    # 5 + 8 tokens takes one 128-token block (CPU) = 64 KiB; 1 MiB holds 16 of the engine's 64.
    assert m.state["kv_cache"] == 2**20
    assert m.concurrency == 16
    assert any("holds 16 of 64 sequences" in n for n in m.notes), m.notes
    m, _ = _cpu_memory(None)  # 256 MiB (rlbatch's CPU default) holds 4096: all 64 run together
    assert m.state["kv_cache"] == 256 * 2**20 and m.concurrency == 64


def test_gpu_kv_cache_mb_replaces_gpu_memory_utilization() -> None:
    cfg = make_config(model={"path": str(MODELS / "qwen2_5_7b")},
                      roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))",
                                  actor_infer={"engine_args": {"kv_cache_mb": 10240, "dtype": "fp16"}}))
    shape = shape_from_config(cfg["model"])
    m = role_memory(make_layout(cfg).roles["actor_infer"], shape, workload_of(cfg, 512), 2, load_hardware("h100_sxm"))
    assert m.state == {"params": pytest.approx(2 * shape.params), "kv_cache": 10240 * 2**20}


def test_prefix_caching_shares_a_prompts_full_blocks_within_its_group() -> None:
    w = replace(workload_of(make_config(), 500), samples_per_prompt=8, response_max=256)
    # GPU, 16-token blocks: 496 prompt tokens in full blocks shared by 8 samples (62 each), the
    # other 4 + 256 tokens in 17 blocks of the sequence's own (272).
    assert tokens_per_sequence(w, 16) == pytest.approx(62 + 272)
    # CPU, 128-token blocks: 384 shared (48 each), 116 + 256 = 372 in 3 own blocks (384).
    assert tokens_per_sequence(w, 128) == pytest.approx(48 + 384)


def test_continuous_batching_keeps_the_batch_full_then_drains() -> None:
    everyone_to_the_cap = np.ones(5)
    # 10 sequences of 5 tokens, 4 slots: the 6 that wait generate 30 tokens in ceil(30/4) = 8 full
    # steps, then the last 4 run their 5 steps.
    b = decode_batches(10, 4, everyone_to_the_cap)
    assert b.tolist() == [4.0] * 8 + [4.0] * 5
    assert decode_batches(3, 4, np.array([1.0, 0.5])).tolist() == [3.0, 1.5]  # all fit: they just drain


def _generate(prompts: int, **algo: int):  # type: ignore[no-untyped-def]
    cfg = make_config(model={"path": str(MODELS / "qwen2_5_7b")},
                      algo={"prompts_per_step": prompts, "samples_per_prompt": 1, "max_new_tokens": 256, **algo},
                      roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    shape = shape_from_config(cfg["model"])
    w = workload_of(cfg, 512, 1.0)  # every response runs to the cap: 256 decode steps
    p = predict(make_layout(cfg), shape, w, load_hardware("h100_sxm"))
    g = p.phase("generate")
    assert g is not None
    return g.features, shape


def test_batched_decode_is_bandwidth_bound() -> None:
    hw = load_hardware("h100_sxm")
    one, shape = _generate(8)  # one sequence per engine
    weights, bw, flops = 2 * shape.params, hw.hbm_bw * hw.mbu, hw.peak_flops * hw.mfu
    # By hand: the prefill of 512 tokens is compute-bound; each of 256 decode steps reads the
    # weights once (the KV cache and activations of one sequence are < 1 % of them).
    prefill = 512 * shape.fwd_flops_per_token(256) / flops
    assert one["roofline"] == pytest.approx(prefill + 256 * weights / bw, rel=0.01)
    # 32 sequences per engine decode together: each step still reads the weights once, plus 32 KV
    # caches of ~640 tokens x 56 KiB (8 % of the weights): decode costs little more while it
    # generates 32 times the tokens. (Their 32 prefills are compute-bound: 32 times one.)
    many, _ = _generate(256)
    decode_one, decode_many = one["roofline"] - prefill, many["roofline"] - 32 * prefill
    assert decode_one < decode_many < 1.12 * decode_one


def test_search_keeps_to_the_tensor_parallel_sizes_vllm_accepts() -> None:
    shape = shape_from_config({"path": str(MODELS / "qwen2_5_7b")})  # 28 query heads, 4 KV heads
    assert infer_dims("vllm", 8, 8, shape) == ["vllm:d8", "vllm:d4t2", "vllm:d2t4"]  # t=8 splits 28 heads unevenly
    odd = replace(shape, heads=6, kv_heads=3)  # t=2 divides the 6 query heads but not the 3 KV heads
    assert "vllm:d4t2" not in infer_dims("vllm", 8, 8, odd)


def test_search_chooses_tensor_parallel_vllm_when_one_gpu_cannot_hold_the_model() -> None:
    cfg = make_config(model={"path": str(MODELS / "qwen2_5_72b")},
                      algo={"max_new_tokens": 512, "prompts_per_step": 64, "grad_accum": 8},
                      roles=roles("fsdp:d64", "vllm:d64", "list(range(0,64))", "list(range(0,64))", micro_batch=1))
    shape = shape_from_config(cfg["model"])
    best, stats = search(cfg, 64, 8, shape, workload_of(cfg, 512), load_hardware("h100_sxm"), Coefficients(),
                         "auto", top=3)
    assert best, stats
    # 145 GB of bf16 weights do not fit on one 80 GB GPU: every winner splits vLLM over t >= 2.
    for c in best:
        b = c.layout.roles["actor_infer"].backend
        assert b is not None and b.t >= 2, c.label
        assert f"roles.actor_infer.backend={b}" in c.overrides
