"""What vLLM would refuse once the ranks are up is refused by ``check(cfg)`` before anything
starts, naming the field and the numbers (``rlbatch/engines/vllm/rules.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.errors import ConfigError
from tests.unit.configs import problems, set_
from tests.unit.test_validate import on_ranks

CPU_SIZES = "{32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}"


def vllm(c: dict[str, Any], n: int, infer: str, **model: Any) -> dict[str, Any]:
    """actor_infer on vLLM colocated with fsdp:dN on ranks [0, n), on CPU, with a random-init model."""
    out = set_(on_ranks(c, n, f"fsdp:d{n}", infer), cluster__device="cpu")
    for k, v in model.items():
        out = set_(out, **{f"model__{k}": v})
    return out


def mine(lines: list[str], field: str) -> list[str]:
    """The lines of one field (the dims line of a build without vllm t>1 may come beside them)."""
    return [x for x in lines if x.startswith(field)]


def lines_of(c: dict[str, Any]) -> list[str]:
    """Every problem of ``c``; none when it is accepted."""
    try:
        check(c)
    except ConfigError as e:
        return e.problems
    return []


# ------------------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize(("heads", "kv", "t", "why", "valid"), [
    (6, 6, 4, "num_heads=6 is not divisible by t=4", "[1, 2, 3, 6]"),
    (6, 3, 2, "num_kv_heads=3 is not divisible by t=2", "[1, 3, 6]"),
    (6, 2, 3, "t=3 is not a multiple of num_kv_heads=2 (each KV head would be replicated 1.5 times)", "[1, 2, 6]"),
])
def test_a_tensor_parallel_size_vllm_cannot_split_the_heads_over_is_refused(
        cfg: dict[str, Any], heads: int, kv: int, t: int, why: str, valid: str) -> None:  # noqa: F811
    c = set_(vllm(cfg, t, f"vllm:d1t{t}", hidden_size=32 * heads, num_heads=heads, num_kv_heads=kv),
             algo__prompts_per_step=12)  # 192 samples split over dp=t x 2 mini-batches
    line = (f"roles.actor_infer.backend: 'vllm:t{t}' splits attention over t={t} tensor-parallel ranks, but "
            f"{why}; vLLM accepts t in {valid} for this model (num_heads={heads}, num_kv_heads={kv})")
    assert mine(problems(c), "roles.actor_infer.backend: 'vllm") == [line]


def test_kv_heads_are_replicated_when_t_is_a_multiple_of_them(cfg: dict[str, Any]) -> None:  # noqa: F811
    c = vllm(cfg, 4, "vllm:d1t4", hidden_size=256, num_heads=8, num_kv_heads=2)
    assert not mine(lines_of(c), "roles.actor_infer.backend: 'vllm")


def test_the_heads_of_a_model_directory_are_read_from_its_config(cfg: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2,
        "num_hidden_layers": 28, "intermediate_size": 8960, "vocab_size": 151936, "max_position_embeddings": 32768}))
    c = set_(vllm(cfg, 8, "vllm:d1t8"), model__path=str(model), cluster__gpus_per_node=8, algo__prompts_per_step=8)
    assert ("roles.actor_infer.backend: 'vllm:t8' splits attention over t=8 tensor-parallel ranks, but "
            "num_heads=12 is not divisible by t=8; vLLM accepts t in [1, 2, 4, 6, 12] for this model "
            "(num_heads=12, num_kv_heads=2)") in problems(c)


# ----------------------------------------------------------------------------- head size


def test_a_head_size_vllms_cpu_attention_has_no_kernel_for_is_refused(cfg: dict[str, Any]) -> None:  # noqa: F811
    c = vllm(cfg, 2, "vllm:d2")  # the default tiny model: hidden 64, 4 heads of 16
    assert problems(c) == [f"roles.actor_infer: vllm on CPU needs head_dim in {CPU_SIZES}; model has hidden 64 / "
                           f"4 heads = 16: set model.num_heads=2 model.num_kv_heads=2"]
    check(set_(c, model__num_heads=2, model__num_kv_heads=1))  # head_dim 32: the fix the line gives runs
    check(c, runnable=False)  # the planner models any device
    assert problems(vllm(cfg, 2, "vllm:d2", hidden_size=48, num_heads=2, num_kv_heads=1)) == [
        f"roles.actor_infer: vllm on CPU needs head_dim in {CPU_SIZES}; model has hidden 48 / 2 heads = 24: "
        f"no head count splits hidden 48 into a supported size: change model.hidden_size"]


def test_the_head_size_is_not_a_cpu_rule_on_a_gpu(cfg: dict[str, Any]) -> None:  # noqa: F811
    check(set_(vllm(cfg, 2, "vllm:d2"), cluster__device="cuda"), runnable=True)


# ------------------------------------------------------------------------------- KV cache


def test_kv_cache_of_a_nodes_ranks_larger_than_its_memory_is_refused(cfg: dict[str, Any]) -> None:  # noqa: F811
    c = vllm(cfg, 2, "vllm:d2", num_heads=2, num_kv_heads=1)
    big = set_(c, roles__actor_infer__engine_args={"kv_cache_mb": 16384}, cluster__mem_gb=24)
    assert problems(big) == [
        "roles.actor_infer.engine_args.kv_cache_mb: 2 vLLM ranks on node 0 x 16384 MiB KV cache (kv_cache_mb=16384) "
        "= 32768 MiB > 24576 MiB memory of a node (cluster.mem_gb=24); lower kv_cache_mb or spread actor_infer over "
        "more nodes"]
    check(set_(big, cluster__gpus_per_node=1))  # one rank per node: 16384 MiB fits in 24 GiB
    check(big, runnable=False)


def test_without_mem_gb_a_local_run_is_judged_against_this_machine(cfg: dict[str, Any]) -> None:  # noqa: F811
    mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    c = set_(vllm(cfg, 2, "vllm:d2", num_heads=2, num_kv_heads=1),
             roles__actor_infer__engine_args={"kv_cache_mb": int(mib * 0.6)})
    (line,) = problems(c)
    assert line.endswith(f"> {mib:.0f} MiB memory of a node (this machine); lower kv_cache_mb or spread "
                         f"actor_infer over more nodes")
    check(set_(c, roles__actor_infer__engine_args={"kv_cache_mb": int(mib * 0.4)}))


def test_kv_cache_larger_than_the_gpu_minus_the_weights_is_refused(cfg: dict[str, Any]) -> None:  # noqa: F811
    # bf16 weights (model.dtype auto on a GPU): 2 bytes a parameter.
    c = set_(vllm(cfg, 2, "vllm:d2", hidden_size=1024, num_heads=8, num_kv_heads=8, num_layers=4,
                  intermediate_size=2816), cluster__device="cuda", hardware={"hbm_bytes": 2**30})
    from rlbatch.models.shape import shape_from_config

    params = shape_from_config(c["model"]).params
    weights = 2 * params / 2**20
    free = 1024 - weights
    over = set_(c, roles__actor_infer__engine_args={"kv_cache_mb": 1000})
    assert problems(over) == [
        f"roles.actor_infer.engine_args.kv_cache_mb: 1000 MiB KV cache > 1024 MiB GPU memory (the hardware config's "
        f"hbm_bytes) - {weights:.0f} MiB weights per GPU (qwen2-h1024-l4 at 2 bytes over t*p=1) = {free:.0f} MiB"]
    check(set_(c, roles__actor_infer__engine_args={"kv_cache_mb": int(free) - 1}))
    low = set_(c, roles__actor_infer__engine_args={"gpu_memory_utilization": 0.05})
    assert problems(low) == [
        f"roles.actor_infer.engine_args.gpu_memory_utilization: 0.05 x 1024 MiB GPU memory (the hardware config's "
        f"hbm_bytes) = 51 MiB leaves no KV cache after {weights:.0f} MiB weights per GPU"]
    assert problems(set_(c, roles__actor_infer__engine_args={"gpu_memory_utilization": 1.5})) == [
        "roles.actor_infer.engine_args.gpu_memory_utilization: must be in (0, 1], got 1.5"]


def test_a_profile_named_in_the_hardware_config_gives_the_gpu_memory(cfg: dict[str, Any]) -> None:  # noqa: F811
    c = set_(vllm(cfg, 2, "vllm:d2"), cluster__device="cuda", hardware={"name": "h100_sxm"},
             roles__actor_infer__engine_args={"kv_cache_mb": 81_920})
    (line,) = problems(c)  # the profile: 80 GiB of HBM3, less the tiny model's weights
    assert line.startswith("roles.actor_infer.engine_args.kv_cache_mb: 81920 MiB KV cache > 81920 MiB GPU memory "
                           "(the hardware config's hbm_bytes) - 0 MiB weights per GPU")


def test_a_kv_cache_smaller_than_one_sequence_of_max_model_len_is_refused(cfg: dict[str, Any]) -> None:  # noqa: F811
    # 2 layers x (K and V) x 1 KV head x head_dim 32 x 4 bytes (fp32 on CPU) = 512 bytes a token;
    # 4096 tokens (32 blocks of 128) = 2 MiB > 1 MiB.
    c = set_(vllm(cfg, 2, "vllm:d2", num_heads=2, num_kv_heads=1, max_position_embeddings=4096),
             roles__actor_infer__engine_args={"kv_cache_mb": 1})
    assert problems(c) == [
        "roles.actor_infer.engine_args.kv_cache_mb: one sequence of max_model_len=4096 tokens needs 2.0 MiB of KV "
        "cache per rank > 1 MiB (vLLM refuses to start); raise kv_cache_mb or lower max_model_len"]
    check(set_(c, roles__actor_infer__engine_args={"kv_cache_mb": 1, "max_model_len": 2048}))
    assert problems(set_(c, roles__actor_infer__engine_args={"max_model_len": 8192})) == [
        "roles.actor_infer.engine_args.max_model_len: 8192 > the model's max_position_embeddings 4096 (vLLM refuses it)"]
