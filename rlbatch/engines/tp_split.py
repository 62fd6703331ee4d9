"""How t tensor-parallel ranks split a model's attention heads, as vLLM splits them (SGLang splits
them alike): its rule, the sizes it accepts, validation's line when a size breaks it. Torch-free:
the engines' rules and the planner read it."""

from __future__ import annotations


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
