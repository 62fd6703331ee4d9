"""The generic generation model: prefill, then decode step by step, the busiest engine setting the
phase time (``generate``). ``EngineCost.generate`` (rlbatch.plan.costs) uses it with the engine's
batching and prompt sharing; an engine with a model of its own (vLLM's) overrides it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from rlbatch.config.hardware import Hardware
from rlbatch.models.shape import OPS_PER_LAYER_DECODE, OPS_PER_MODEL_FWD, ModelShape
from rlbatch.plan import comm
from rlbatch.plan.activations import traffic_per_token
from rlbatch.plan.layout import Layout, RoleLayout
from rlbatch.plan.rates import cpu_attention_ops, rates, tp_link
from rlbatch.plan.workload import Workload

if TYPE_CHECKING:
    from rlbatch.plan.costs import EngineCost
    from rlbatch.plan.memory import RoleMemory

SAMPLING_OPS = 220
"""Op-equivalents per HF generate step outside the model: logits processors, softmax,
multinomial, stopping criteria, bookkeeping (a decode step costs 2.05 ms + 1.2 ms per layer on
the cpu profile; the model's share is OPS_PER_MODEL_FWD + OPS_PER_LAYER_DECODE per layer)."""
GENERATE_SETUP_OPS = 170
"""Op-equivalents of one HF generate call's setup (generation config, processors, cache)."""
CONTINUOUS_STEP_S = 0.5e-3
"""Assumed CPU-side cost of one step of a continuous-batching engine on a GPU (vLLM's: scheduler,
CUDA-graph replay, sampler launch)."""
SAMPLE_OPS_GENERATE = 1.6
"""Host work per generated sample on its rank outside the model: the prompt's tokens (encoded once
per distinct prompt), left padding, the response's list and tensor, two sample-store puts.
Measured on the cpu profile's VM (op_overhead_s 5.8 us) at 9.3-13.9 us (``python -m
rlbatch.plan.measure`` prints these constants)."""


def generate(r: RoleLayout, mem: RoleMemory, shape: ModelShape, w: Workload, e: int, hw: Hardware,
             layout: Layout, cost: EngineCost) -> dict[str, float]:
    """Prefill, then decode step by step; the busiest engine sets the phase time; ``cost``, the
    engine's model, says how it batches and whether it shares prompts (``EngineCost.generate``
    calls this; vLLM has a model of its own, ``rlbatch.engines.vllm.cost``: continuous batching, prefix
    caching, its host costs)."""
    b = r.backend
    assert b is not None
    tp, pp = b.t, b.p
    seqs = math.ceil(w.sequences / max(1, b.d))
    rt = rates(hw, layout, layout.ranks_per_node(r.ranks), sum(mem.transient.get("generate", {}).values()))
    weights = e * shape.params / (tp * pp)
    kv_tok = mem.kv_needed / max(1e-9, seqs * w.seq_len)
    split = tp * pp
    # Prefill: every prompt token once, weights read once. The hf engine runs each distinct prompt
    # but its last token once, then the last token of every row (one more model call per wave).
    shared = not w.image_tokens and cost.shares_prompts(r, w, seqs, False)  # hf shares no prompt with images
    if shared:
        tokens = w.distinct_prompts(seqs) * max(w.prompt_len - 1, 0) + seqs
    else:
        tokens = seqs * w.prompt_len
    traffic = traffic_per_token(shape, e, tp) / pp
    images = w.distinct_prompts(seqs) if shared else seqs  # a vision tower runs on each prompt's images
    roof = max((tokens * shape.fwd_flops_per_token(w.prompt_len / 2) + images * w.vision_flops) / split / rt.flops,
               (weights + tokens * traffic) / rt.bw)
    lk = tp_link(layout, r, hw)
    comm_s = 2 * shape.layers / pp * comm.all_reduce(tokens * shape.hidden * e, tp, lk)
    # Decode: the batch shrinks as sequences finish (vLLM) or stays whole until the last one
    # finishes (HF generate keeps finished rows in the batch).
    conc = max(1, mem.concurrency or seqs)
    waves = math.ceil(seqs / conc)
    surv = w.survival()
    batch = conc * (surv if cost.continuous_batching else np.ones_like(surv))
    ctx = w.prompt_len + np.arange(len(surv), dtype=float)
    a0 = shape.fwd_flops_per_token(0.0)
    a1 = 4.0 * shape.layers * shape.heads * shape.head_dim
    flops = batch * (a0 + a1 * ctx) / split
    byts = weights + batch * (kv_tok * ctx + traffic + shape.vocab * 4.0 * 3)
    step_s = np.maximum(flops / rt.flops, byts / rt.bw)
    if pp > 1:  # fewer running sequences than stages leaves stages idle (the tail of the batch)
        step_s *= np.maximum(1.0, pp / np.maximum(batch, 1e-9))
    roof += waves * float(step_s.sum())
    steps = waves * len(surv)
    if cost.continuous_batching:
        overhead = (steps + waves) * CONTINUOUS_STEP_S
    else:
        layers = math.ceil(shape.layers / pp)
        per_step = OPS_PER_MODEL_FWD + layers * OPS_PER_LAYER_DECODE + SAMPLING_OPS
        ops = waves * GENERATE_SETUP_OPS + (steps + waves * (2 if shared else 1)) * per_step
        overhead = ops * hw.op_overhead_s * rt.slow
    if tp > 1:  # two all-reduces per layer per step; linear in size, so sum the batch once
        hop = comm.all_reduce(0.0, tp, lk)
        per_byte = comm.all_reduce(1.0, tp, lk) - hop
        comm_s += waves * 2 * shape.layers / pp * (len(batch) * hop + per_byte * float(batch.sum()) * shape.hidden * e)
    per_seq = SAMPLE_OPS_GENERATE + (cpu_attention_ops(shape, pp) * (steps / waves + 1) if hw.is_cpu else 0.0)
    samples = seqs * per_seq * hw.op_overhead_s * rt.slow
    return {"roofline": roof, "overhead": overhead, "comm": comm_s, "samples": samples, "fixed": 1.0}
