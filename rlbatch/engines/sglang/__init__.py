"""The ``sglang`` inference engine: an in-rank ``sglang.Engine`` per worker (SGLang's CPU engine on a
machine without a GPU; docs/sglang.md). Its spec and typed engine_args are here; the engine is
``engine``, the SGLang plugin it loads ``plugin``, its checks before start ``rules``, its cost model
``rlbatch.engines.sglang.cost``."""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.config.bounds import bounded
from rlbatch.engines.registry import EngineKind, EngineSpec, register


@dataclass(frozen=True)
class SGLangArgs:
    """engine_args of the ``sglang`` inference engine (an in-rank ``sglang.Engine`` per rank; on a
    machine without a GPU, SGLang's CPU engine). See docs/sglang.md."""

    mem_fraction_static: float = bounded(0.88, gt=0, le=1)
    """GPU: share of the GPU SGLang reserves for weights and KV cache (ignored on CPU)."""
    max_num_batched_tokens: int = 8192
    """Tokens per prefill chunk (SGLang's chunked_prefill_size)."""
    max_num_seqs: int = 256
    """Requests decoded together (SGLang's max_running_requests)."""
    kv_cache_tokens: int = 0
    """Tokens the KV cache holds (SGLang's max_total_tokens). 0: on a GPU, what mem_fraction_static
    leaves; on CPU, 16384 (SGLang would otherwise size it from the node's memory)."""
    max_model_len: int = 0
    """Longest prompt + response (0: the model's max_position_embeddings)."""
    dtype: str = "auto"
    """Weights and activations: 'auto' (the run's model.dtype: bf16 on GPU, fp32 on CPU), 'bf16',
    'fp16' or 'fp32'."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype: must be 'auto', 'bf16', 'fp16' or 'fp32', got {self.dtype!r}")


# dims "dt": data-parallel SGLang workers of t tensor-parallel ranks each, one engine per worker on
# its first rank (SGLang spawns the t scheduler processes itself). Weights land mid-generation by
# pausing SGLang's scheduler; on a worker of t > 1 the followers join each sync while they wait for
# the leader's generations (in_flight_tp "leader").
register(EngineSpec("sglang", EngineKind.INFER, SGLangArgs, "rlbatch.engines.sglang.engine:build", dims="dt",
                    reserves_device_share=True, loads_in_flight=True, in_flight_tp="leader",
                    cost="rlbatch.engines.sglang.cost:SGLangCost",
                    rules="rlbatch.engines.sglang.rules:sglang_problems",
                    sync_check_floor=1e-2))  # its own kernels, as vllm's
