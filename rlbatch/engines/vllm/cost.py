"""vLLM's memory and generation time, as rlbatch's vllm engine runs it.

**Memory** (per GPU rank; on CPU profiles per rank in the node's RAM):

- weights: ``dtype`` bytes (engine_args.dtype, else the run's) x parameters / (t x p);
- activations: vLLM profiles one forward of ``max_num_batched_tokens`` tokens and the sampler's
  fp32 logits of ``max_num_seqs`` sequences, and keeps that much free;
- KV cache: ``kv_cache_mb`` when set; otherwise on a GPU what ``gpu_memory_utilization`` of it
  leaves after weights and activations, on CPU rlbatch's default (``CPU_KV_CACHE_MB``);
- concurrency: the cache holds whole blocks (16 tokens on a GPU, 128 on CPU); with prefix caching
  a prompt's full blocks are shared by its ``samples_per_prompt`` samples, so a sequence costs
  its share of the prompt plus its own blocks. Sequences decoded together are the fewest of the
  engine's share, ``max_num_seqs`` and what the cache holds.

**Time** (continuous batching, unlike HF ``generate``):

- prefill: each distinct prompt once (prefix caching), in chunks of ``max_num_batched_tokens``;
  each chunk reads the weights once;
- decode: one step per token of the running batch; a finished sequence leaves at once and a
  waiting one takes its place, so the batch stays at the concurrency while sequences wait and
  then drains along the responses' length distribution. A step reads the weights once for the
  whole batch plus each sequence's KV cache: batched decode is bandwidth-bound until the batch
  is large enough to be compute-bound (``max`` of the two, step by step);
- host work: ``CONTINUOUS_STEP_S`` per engine step on a GPU (CUDA graphs); on CPU profiles vLLM runs
  eagerly, so a step costs the model's ops (``OPS_PER_MODEL_FWD`` + layers x
  ``VLLM_CPU_OPS_PER_LAYER``) and each generated token ``VLLM_TOKEN_OPS`` (scheduler, sampler,
  output processing), times ``op_overhead_s``.
"""

from __future__ import annotations

import math

import numpy as np

from rlbatch.config.hardware import Hardware
from rlbatch.engines.tp_split import kv_heads_per_rank, tp_heads_problem
from rlbatch.engines.vllm import VLLMArgs
from rlbatch.engines.vllm.limits import (
    BLOCK_TOKENS_CPU,
    BLOCK_TOKENS_GPU,
    CPU_KV_CACHE_MB,
)
from rlbatch.models.shape import OPS_PER_MODEL_FWD, ModelShape
from rlbatch.plan import activations as act
from rlbatch.plan import comm
from rlbatch.plan.costs import EngineCost
from rlbatch.plan.generation import CONTINUOUS_STEP_S
from rlbatch.plan.layout import Layout, RoleLayout
from rlbatch.plan.memory import RoleMemory, largest_tensor
from rlbatch.plan.rates import rates, tp_link
from rlbatch.plan.workload import Workload

VLLM_CPU_OPS_PER_LAYER = 60
"""Op-equivalents one decoder layer costs vLLM per step on CPU (eager torch plus its custom CPU
kernels; fewer than HF's ~150-200: fused qkv and gate/up, one attention call per layer)."""
VLLM_TOKEN_OPS = 6
"""Op-equivalents of host work per generated token (scheduling, sampling, appending and
detokenizing the output) on CPU profiles. Prior from the vLLM-vs-hf table of docs/vllm.md
(default tiny model, 512 sequences x 24 tokens: ~30 ms a step): calibrate."""
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def dtype_bytes(r: RoleLayout, e: int) -> int:
    """engine_args.dtype's bytes, else the run's compute bytes ``e``."""
    return _DTYPE_BYTES.get(r.args_as(VLLMArgs).dtype, e)


def _kv_per_token(shape: ModelShape, e: int, t: int, p: int) -> float:
    """KV bytes of one token on one rank: its layers (/p) and KV heads (/t, replicated beyond)."""
    return 2.0 * shape.layers * kv_heads_per_rank(shape.kv_heads, t) * shape.head_dim * e / p


def block_tokens(hw: Hardware) -> int:
    return BLOCK_TOKENS_CPU if hw.is_cpu else BLOCK_TOKENS_GPU


def tokens_per_sequence(w: Workload, block: int) -> float:
    """KV tokens one sequence holds at full length: its share of its prompt's full blocks (prefix
    caching shares them within a group) plus its own blocks for the rest of the prompt and the response."""
    full = (int(w.prompt_len) // block) * block
    own = math.ceil((w.prompt_len - full + w.response_max) / block) * block
    return full / max(1, w.samples_per_prompt) + own


def memory(r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
    """One vLLM rank: weights and KV cache resident, the profiled activations while generating."""
    b = r.backend
    assert b is not None
    ea, e = r.args_as(VLLMArgs), dtype_bytes(r, e)
    tp, pp = b.t, b.p
    weights = e * shape.params / (tp * pp)
    tokens, max_seqs = ea.max_num_batched_tokens, ea.max_num_seqs
    activ = act.forward_working_bytes(shape, tokens, 1, e, tp) + max_seqs * shape.vocab * 4.0
    notes: list[str] = []
    kv_mb = ea.kv_cache_mb
    if kv_mb or hw.is_cpu:
        kv = float((kv_mb or CPU_KV_CACHE_MB) << 20)
        source = f"kv_cache_mb={kv_mb}" if kv_mb else f"{CPU_KV_CACHE_MB} MiB (CPU default)"
    else:
        frac = ea.gpu_memory_utilization
        kv = frac * hw.hbm_bytes - weights - activ
        source = f"gpu_memory_utilization={frac}"
        if kv <= 0:
            notes.append(f"gpu_memory_utilization={frac} leaves no KV cache after {weights / 2**30:.1f} GiB of weights")
    kv = max(0.0, kv)
    seqs = math.ceil(w.sequences / max(1, b.d))
    per_token = _kv_per_token(shape, e, tp, pp)
    block = block_tokens(hw)
    per_seq = tokens_per_sequence(w, block) * per_token
    held = int(kv // per_seq) if per_seq else seqs
    concurrency = max(0, min(seqs, max_seqs, held))
    if 0 < held < min(seqs, max_seqs):
        notes.append(f"vLLM KV cache ({source}: {kv / 2**20:.0f} MiB) holds {held} of {seqs} sequences per engine")
    state = {"params": weights, "kv_cache": kv}
    return RoleMemory(r.name, state, {"generate": {"activations": activ}, "sync": {}}, notes,
                      kv_needed=seqs * w.seq_len * per_token, concurrency=concurrency, tensors=math.ceil(shape.tensors / pp))


def decode_batches(seqs: int, conc: int, survival: np.ndarray) -> np.ndarray:
    """Running sequences at each decode step under continuous batching: ``conc`` while sequences
    wait for a slot, then the last ``conc`` drain along ``survival``."""
    conc = max(1, min(conc, seqs))
    tail = conc * survival
    waiting_tokens = (seqs - conc) * float(survival.sum())  # what the waiting sequences generate
    full_steps = int(math.ceil(waiting_tokens / conc))
    return np.concatenate([np.full(full_steps, float(conc)), tail])


def generate(r: RoleLayout, mem: RoleMemory, shape: ModelShape, w: Workload, e: int, hw: Hardware,
             layout: Layout) -> dict[str, float]:
    """Features of one generate phase on the busiest vLLM engine."""
    b = r.backend
    assert b is not None
    e = dtype_bytes(r, e)
    tp, pp, split = b.t, b.p, b.t * b.p
    seqs = math.ceil(w.sequences / max(1, b.d))
    rt = rates(hw, layout, layout.ranks_per_node(r.ranks), sum(mem.transient.get("generate", {}).values()))
    weights = e * shape.params / split
    kv_tok = _kv_per_token(shape, e, tp, pp)
    traffic = act.traffic_per_token(shape, e, tp) / pp
    # Prefill: each distinct prompt once, in chunks of max_num_batched_tokens; a chunk reads the weights.
    tokens = w.distinct_prompts(seqs) * w.prompt_len
    chunks = max(1, math.ceil(tokens / r.args_as(VLLMArgs).max_num_batched_tokens))
    roof = max(tokens * shape.fwd_flops_per_token(w.prompt_len / 2) / split / rt.flops,
               (chunks * weights + tokens * traffic) / rt.bw)
    lk = tp_link(layout, r, hw)
    comm_s = 2 * shape.layers / pp * comm.all_reduce(tokens * shape.hidden * e, tp, lk) if tp > 1 else 0.0
    # Decode: continuous batching; the context grows with the step (the drain's steps are the tail's).
    batch = decode_batches(seqs, mem.concurrency or seqs, w.survival())
    surv = w.survival()
    pos = np.concatenate([np.full(len(batch) - len(surv), float(surv.sum()) / 2), np.arange(len(surv), dtype=float)])
    ctx = w.prompt_len + pos
    flops = batch * (shape.fwd_flops_per_token(0.0) + 4.0 * shape.layers * shape.heads * shape.head_dim * ctx) / split
    byts = weights + batch * (kv_tok * ctx + traffic + shape.vocab * 4.0 * 3)
    step_s = np.maximum(flops / rt.flops, byts / rt.bw)
    if pp > 1:  # fewer running sequences than stages leaves stages idle
        step_s *= np.maximum(1.0, pp / np.maximum(batch, 1e-9))
    roof += float(step_s.sum())
    steps = len(batch) + chunks
    if tp > 1:  # two all-reduces per layer per step, linear in the batch
        hop = comm.all_reduce(0.0, tp, lk)
        per_byte = comm.all_reduce(1.0, tp, lk) - hop
        comm_s += 2 * shape.layers / pp * (len(batch) * hop + per_byte * float(batch.sum()) * shape.hidden * e)
    generated = float(batch.sum())
    if hw.is_cpu:
        layers = math.ceil(shape.layers / pp)
        ops = steps * (OPS_PER_MODEL_FWD + layers * VLLM_CPU_OPS_PER_LAYER) + generated * VLLM_TOKEN_OPS
        overhead = ops * hw.op_overhead_s * rt.slow
    else:
        overhead = steps * CONTINUOUS_STEP_S
    return {"roofline": roof, "overhead": overhead, "comm": comm_s, "samples": 0.0, "fixed": 1.0}


class VLLMCost(EngineCost):
    """vLLM as the planner models it (``EngineSpec.cost``): this module's memory and generation."""

    continuous_batching = True

    def generate(self, r: RoleLayout, mem: RoleMemory, shape: ModelShape, w: Workload, e: int, hw: Hardware,
                 layout: Layout) -> dict[str, float]:
        return generate(r, mem, shape, w, e, hw, layout)

    def pipeline_sizes(self, t: int, gpn: int) -> list[int]:
        """Pipeline stages across whole nodes only."""
        return [1, 2, 4, 8] if t == gpn else [1]

    def tensor_split_problem(self, t: int, shape: ModelShape) -> bool:
        """The sizes vLLM splits the model's query and KV heads over."""
        return tp_heads_problem(t, shape.heads, shape.kv_heads) is not None

    def load_bytes(self, r: RoleLayout, shape: ModelShape, e: int, hw: Hardware) -> float:
        """Its loader reads a tensor at a time and copies its part to the device (vLLM's random-init
        path, the whole fp32 model saved for vLLM to read, is not modelled)."""
        return e * largest_tensor(shape)

    def infer_memory(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
        return memory(r, shape, w, e, hw)
