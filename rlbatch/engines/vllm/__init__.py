"""The ``vllm`` inference engine: an in-process ``vllm.LLM`` per rank (vLLM's CPU build on a machine
without a GPU; docs/vllm.md). Its spec and typed engine_args are here; the engine is ``engine``, its
private world ``world``, what vLLM accepts ``limits``, its checks before start ``rules``, its cost
model ``rlbatch.engines.vllm.cost``."""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.config.bounds import bounded
from rlbatch.engines.registry import EngineKind, EngineSpec, register


@dataclass(frozen=True)
class VLLMArgs:
    """engine_args of the ``vllm`` inference engine (an in-process ``vllm.LLM`` per rank; on a
    machine without a GPU, vLLM's CPU build). See docs/vllm.md."""

    gpu_memory_utilization: float = bounded(0.9, gt=0, le=1)
    """GPU: share of the GPU vLLM reserves for weights, activations and KV cache (ignored when
    kv_cache_mb is set, and on CPU)."""
    kv_cache_mb: int = 0
    """KV cache size in MiB. 0: on a GPU, what gpu_memory_utilization leaves; on CPU,
    ``VLLM_CPU_KV_CACHE_MB`` (256 MiB). Without a size vLLM's CPU build takes ~90% of the node's memory."""
    max_num_batched_tokens: int = 8192
    """Tokens per scheduler step (chunked prefill)."""
    max_num_seqs: int = 256
    """Sequences decoded together."""
    max_model_len: int = 0
    """Longest prompt + response (0: the model's max_position_embeddings)."""
    enforce_eager: bool = False
    """No CUDA graphs and no torch.compile. On CPU the engine runs eager unless cpu_compile."""
    cpu_compile: bool = False
    """CPU: compile the model as vLLM does by default (torch.compile): ~30 s more start-up, a ~15%
    shorter generate phase on an AVX-512 CPU (docs/benchmarks.md). Off: eager, which starts in seconds."""
    enable_prefix_caching: bool = True
    """Share the KV cache of a prompt's samples (a GRPO group) and of repeated prefixes."""
    dtype: str = "auto"
    """Weights and activations: 'auto' (the run's model.dtype: bf16 on GPU, fp32 on CPU), 'bf16',
    'fp16' or 'fp32'."""


# dims "dt": data-parallel vLLM workers of t tensor-parallel ranks each; backend strings may name p
# too ("dtp"), so plans with pipeline-parallel vLLM are still modelled.
register(EngineSpec("vllm", EngineKind.INFER, VLLMArgs, "rlbatch.engines.vllm.engine:VLLMEngine", dims="dt",
                    planned_dims="dtp",
                    note="pipeline-parallel vLLM (p>1) is not built: rlbatch runs vLLM inside its ranks through vLLM's "
                         "external launcher, which vLLM builds for tensor parallelism (every rank one engine over "
                         "the same requests); its pipeline stages run under vLLM's own multiprocessing or Ray "
                         "executors; use vllm:dXtY", reserves_device_share=True,
                    loads_adapters=True, loads_in_flight=True, in_flight_tp="lockstep",
                    cost="rlbatch.engines.vllm.cost:VLLMCost",
                    rules="rlbatch.engines.vllm.rules:vllm_problems",
                    # its own kernels, bf16 on a GPU: a broad floor; the baseline measured before training
                    # (rlbatch.loop.synccheck) raises the tolerance where the pair differs more
                    sync_check_floor=1e-2))
