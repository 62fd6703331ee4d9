"""Published memory formulas, each in the form its source states it.

The planner's memory model (``memory.py``) is built from these; the tests check each against
the figures its source prints, so a change here that breaks a published number fails loudly.

- ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 3 and Fig. 1): mixed-precision Adam keeps
  2 bytes of fp16 parameters, 2 of fp16 gradients and K = 12 of fp32 optimizer state (master
  weights, momentum, variance) per parameter, 16 bytes in all; stage 1 shards the K, stage 2 the
  gradients too, stage 3 everything. Fig. 1: 7.5B parameters on 64 GPUs need 120, 31.4, 16.6 and
  1.9 GB per GPU.
- DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/stage3.py; its
  output for bigscience/T0_3B is printed in the Hugging Face DeepSpeed integration docs,
  "Memory requirements"): 18 bytes per parameter over all GPUs plus 4 bytes per parameter of
  the largest layer, with the CPU side scaled by additional_buffer_factor = 1.5.
- Megatron-LM ``compute_weight_and_optimizer_memory`` (megatron/training/theoretical_memory_usage.py):
  the most loaded shard holds (transformer / pp + embedding) / tp parameters at 18 bytes each, or
  6 + 12 / dp with the distributed optimizer.
- Korthikanti et al. 2022 (arXiv:2205.05198, Sec. 4 and Table 2): activations of one transformer
  layer in 16-bit are s*b*h*(34 + 5*a*s/h) bytes, divided by t with tensor + sequence
  parallelism, s*b*h*(10 + 24/t + 5*a*s/(h*t)) with tensor parallelism alone, 34*s*b*h/t with
  selective recompute, and 2*s*b*h (the layer input) with full recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

ADAM_K = 12
"""ZeRO's K: bytes of fp32 optimizer state per parameter (master copy 4 + momentum 4 + variance 4)."""


def zero_model_states_bytes(params: float, stage: int, dp: int, k: int = ADAM_K) -> float:
    """Per-GPU model-state bytes of mixed-precision Adam under ZeRO ``stage`` (0 = plain DDP)."""
    if stage == 0:
        return (2 + 2 + k) * params
    if stage == 1:
        return 2 * params + 2 * params + k * params / dp
    if stage == 2:
        return 2 * params + (2 + k) * params / dp
    if stage == 3:
        return (2 + 2 + k) * params / dp
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")


@dataclass(frozen=True)
class Zero3Estimate:
    """DeepSpeed's estimate: bytes per CPU (node) and per GPU for ZeRO-3."""

    cpu_bytes: float
    gpu_bytes: float


def deepspeed_zero3_estimate(
    total_params: float, largest_layer_params: float, gpus_per_node: int = 1, nodes: int = 1,
    offload_optimizer: bool = False, offload_params: bool = False, zero_init: bool = True,
    buffer_factor: float = 1.5,
) -> Zero3Estimate:
    """``estimate_zero3_model_states_mem_needs`` of deepspeed/runtime/zero/stage3.py, term by term."""
    gpus = gpus_per_node * nodes
    per_node = 1 / nodes
    largest = 4 * largest_layer_params
    if offload_optimizer and offload_params:
        gpu = largest
        cpu = total_params * (18 * per_node if zero_init else max(4 * gpus_per_node, 18 * per_node))
    elif offload_optimizer:
        gpu = largest + int(2 * total_params / gpus)
        cpu = total_params * (16 * per_node if zero_init else max(4 * gpus_per_node, 16 * per_node))
    else:
        gpu = largest + int(18 * total_params / gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * gpus_per_node
    return Zero3Estimate(cpu_bytes=cpu * buffer_factor, gpu_bytes=gpu)


def megatron_weight_optimizer_bytes(
    layer_params_total: float, embedding_params: float, untied: bool, tp: int, pp: int, dp: int,
    distributed_optimizer: bool,
) -> float:
    """Megatron's weight + optimizer bytes on the most loaded shard (the first pipeline stage).

    ``layer_params_total`` is every transformer-block parameter (layers and final norm).
    """
    shard = (layer_params_total / pp + embedding_params) / tp
    if untied and pp == 1:
        shard += embedding_params / tp
    per_param = 6 + 12 / dp if distributed_optimizer else 18
    return shard * per_param


def korthikanti_layer_bytes(s: float, b: float, h: float, a: float, t: int = 1, sp: bool = True, recompute: str = "none") -> float:
    """Table 2 of Korthikanti et al.: one GPT layer's activation bytes (16-bit, with dropout).

    ``recompute`` is 'none', 'selective' (attention core recomputed) or 'full' (layer input only).
    """
    if recompute == "full":
        return 2 * s * b * h
    attn_core = 5 * a * s / h
    if recompute == "selective":
        attn_core = 0.0
    if sp or t == 1:
        return s * b * h * (34 + attn_core) / t
    return s * b * h * (10 + (24 + attn_core) / t)
