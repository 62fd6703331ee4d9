"""Host memory per rank, by phase and at start-up, against what tools/bench/memory.py measured.

The measurement (docs/benchmarks.md, "Host memory per phase"): a model of Qwen2.5-0.5B's shape on two
CPU ranks, actor_train fsdp:d2, actor_infer hf:d2 and the reference colocated, offload off, 4
sequences of 5 + 4 tokens; each phase's peak RSS of the busier rank (glibc returning freed memory).
The planner must never be below it: a user who plans by it must not run out of memory."""

from __future__ import annotations

import pytest
from conftest import make_config, make_layout, roles, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import shape_from_config
from rlbatch.plan.predict import predict, rank_host_bytes

QWEN2_5_0_5B = dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                    num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=32768)
MEASURED_GIB = {"startup": 4.13, "generate": 6.94, "ref_logprobs": 8.06, "train": 10.31, "sync": 7.96}
"""2026-11-26, tools/bench/memory.py --no-offload --steps 2: the busier of the two ranks, the higher of two runs."""


def _prediction():  # type: ignore[no-untyped-def]
    off = {"offload": False}
    cfg = make_config(model=QWEN2_5_0_5B, algo={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4,
                                                "mini_batches": 1},
                      roles=roles("fsdp:d2", "hf:d2", [0, 1], [0, 1], actor_train=off, actor_infer=off, reference=off))
    shape = shape_from_config(cfg["model"], vocab=151936)
    p = predict(make_layout(cfg), shape, workload_of(cfg, response_mean=4.0), load_hardware("cpu"))
    return p, next(g for g in p.gpus if "actor_train" in g.roles)


def test_the_planner_is_not_below_any_measured_peak() -> None:
    p, g = _prediction()
    assert p.shape.params == 494_032_768
    host = rank_host_bytes(p, g)
    for phase, gib in MEASURED_GIB.items():
        assert host[phase] >= gib * 2**30, (phase, host[phase] / 2**30, gib)
        assert host[phase] <= (gib + 1.0) * 2**30, (phase, host[phase] / 2**30, gib)  # and not far above


def test_start_up_is_the_weights_plus_one_tensor_on_cpu() -> None:
    """The fsdp shards (0.92 GiB each for actor_train and the reference), the hf replica (1.84 GiB)
    and, beside them, the largest one-role transient: the hf engine's embedding read (0.51 GiB)."""
    p, g = _prediction()
    weights = 4 * p.shape.params * (0.5 + 0.5 + 1)
    assert g.startup_host == pytest.approx(weights + 4 * p.shape.embedding_params)
