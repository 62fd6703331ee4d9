"""Device memory of one GPU of one role: its state by kind, and what each of its phases adds.

State kinds are the ones engines offload (DESIGN.md): ``params``, ``grads``, ``optimizer``,
``kv_cache``. Which kinds are resident in each phase depends on what is colocated and offloaded;
``schedule.py`` decides that and sums the roles of a GPU. Sizes are for the most loaded GPU
of the role (the first pipeline stage, which also holds the embedding).

Sources: ZeRO's 16 bytes/param for mixed-precision Adam (FSDP full sharding is ZeRO-3);
DeepSpeed's own ZeRO-3 estimate (18 bytes/param + 4 bytes per param of the largest layer);
Megatron's 18 or 6 + 12/dp bytes on the most loaded shard; see formulas.py. Activations:
activations.py. Inference: vLLM reserves gpu_memory_utilization (default 0.9, vLLM engine
arguments docs) of the GPU for weights, activations and KV cache, whatever the batch needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlbatch.config.schema import HEADS, TRAINABLE_ROLES
from rlbatch.engines.defaults import fsdp_single_unit, hf_max_batch, share_prompts, worth_sharing
from rlbatch.placement import EngineKind
from rlbatch.plan import activations as act
from rlbatch.plan.hardware import Hardware
from rlbatch.plan.layout import RoleLayout
from rlbatch.plan.model import ModelShape
from rlbatch.plan.workload import Workload

VLLM_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default gpu_memory_utilization (EngineArgs)."""
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
"""Tokens vLLM profiles activations for when sizing the KV cache (its chunked-prefill default)."""
VLLM_MAX_NUM_SEQS = 256
"""vLLM's default cap on sequences decoded together."""
SGLANG_MEM_FRACTION = 0.88
"""Assumed share of the GPU SGLang reserves (mem_fraction_static) when engine_args omits it."""
COPIED = ("params", "grads", "optimizer")
"""Kinds an offload copies to host memory (rlbatch's fsdp engine zeroes gradients without freeing
them, so they persist and move); a KV cache is freed and re-allocated instead."""


@dataclass
class RoleMemory:
    """One role on its most loaded GPU."""

    role: str
    state: dict[str, float]
    """Persistent bytes by kind."""
    transient: dict[str, dict[str, float]] = field(default_factory=dict)
    """phase -> term -> bytes the phase allocates on top of the state."""
    notes: list[str] = field(default_factory=list)
    kv_needed: float = 0.0
    """Inference: KV bytes for every sequence of an engine at full length."""
    concurrency: int = 0
    """Inference: sequences an engine can decode at once (bounded by KV cache and max_num_seqs)."""
    tensors: int = 0
    """Parameter tensors per GPU: each costs a few ops to offload, reload or sync."""


def compute_bytes(model_dtype: str, hw: Hardware) -> int:
    """Bytes per element of weights and activations: 'auto' is bf16 on GPUs, fp32 on CPUs."""
    if model_dtype in ("bf16", "fp16"):
        return 2
    if model_dtype == "fp32":
        return 4
    return 4 if hw.is_cpu else 2


def train_micro_batch(w: Workload, dp: int) -> int:
    """Sequences per forward/backward: a rank's share of a mini-batch over grad_accum."""
    return max(1, math.ceil(w.sequences / (w.mini_batches * w.grad_accum * dp)))


def logprob_micro_batch(r: RoleLayout, w: Workload) -> int:
    """Sequences per log-prob forward: engine_args.micro_batch, else the rank's whole share."""
    assert r.backend is not None
    share = max(1, math.ceil(w.sequences / r.backend.d))
    return min(share, int(r.engine_args.get("micro_batch", 0)) or share)


def fsdp_units(r: RoleLayout, shape: ModelShape) -> int:
    """rlbatch's fsdp engine makes a small model one unit, a larger one a unit per layer plus the root."""
    if r.backend is not None and r.backend.engine == "fsdp" and fsdp_single_unit(4 * shape.params, r.engine_args):
        return 1
    return shape.layers + 1


def pass_tokens(r: RoleLayout, w: Workload, mb: int, s: float) -> tuple[float, float, int]:
    """(tokens, logit rows, model calls) of one micro-batch of ``mb`` sequences. rlbatch's fsdp
    engine runs each distinct prompt once with only its last position's logits, then the
    responses (all but their last token) on its cache: two model calls
    (``rlbatch.engines.batch``); otherwise every sequence runs whole, logits at every position."""
    b = r.backend
    assert b is not None
    distinct = w.distinct_prompts(mb)
    trained = r.name in TRAINABLE_ROLES  # as the ranks decide which engines train (and recompute)
    if (b.engine == "fsdp" and b.c == 1 and share_prompts(r.engine_args) and not (trained and w.recompute)
            and worth_sharing(distinct, mb)):
        suffix = mb * max(w.response_max - 1, 0)
        return distinct * w.prompt_len + suffix, distinct + suffix, 2
    return mb * s, mb * s, 1


def train_engine(r: RoleLayout, shape: ModelShape, w: Workload, e: int, forward_only: bool) -> RoleMemory:
    """fsdp / deepspeed / megatron: weights, grads and Adam state by sharding; activations by micro-batch."""
    assert r.backend is not None
    b, P = r.backend, float(shape.params)
    d, t, p, c = b.d, b.t, b.p, b.c
    ea = r.engine_args
    notes: list[str] = []
    big_unit = max(shape.layer_params, shape.embedding_params)
    if b.engine == "fsdp":
        n = d * c
        # rlbatch's fsdp engine loads fp32 weights and shards them (bf16 only for compute on GPUs),
        # so even the forward-only reference keeps 4 bytes per parameter shard.
        state = {"params": 4 * P / t / n}
        if not forward_only:
            state |= {"grads": 4 * P / t / n, "optimizer": 8 * P / t / n}
        # Unsharded all-gather outputs: the current and the prefetched unit (a layer, or the
        # embedding/lm head), plus in backward one unsharded gradient and its reduce-scatter input.
        buffers = e * (shape.layer_params + big_unit) / t + (0 if forward_only else (e + 4) * big_unit / t)
        if fsdp_units(r, shape) == 1:  # a small model is one unit: all of it unsharded at once
            buffers = e * P / t + (0 if forward_only else (e + 4) * P / t)
        layers_held = shape.layers
    elif b.engine == "deepspeed":
        stage = int(ea.get("zero_stage", 3))
        n = d
        if stage == 3:  # DeepSpeed's estimate: 18 bytes/param over all GPUs + 4 per largest-layer param
            state = {"params": 2 * P / n} if forward_only else {"params": 2 * P / n, "grads": 4 * P / n, "optimizer": 12 * P / n}
            buffers = 4.0 * shape.largest_module_params
        else:
            state = {"params": 2 * P} if forward_only else {
                "params": 2 * P, "grads": 2 * P / (n if stage == 2 else 1), "optimizer": 12 * P / n}
            buffers = 0.0
        # ZeRO-Offload (engine_args): fp32 masters, AdamW state and the fp32 gradient partitions they
        # are stepped with live in host memory; offload_params (stage 3) moves the weights' partitions too.
        if bool(ea.get("offload_optimizer", False)) and not forward_only:
            state["optimizer"] = 0.0
            if stage == 3:
                state["grads"] = 0.0
            notes.append("optimizer offloaded to host")
        if bool(ea.get("offload_params", False)) and stage == 3:
            state["params"] = 0.0
            notes.append("parameters offloaded to host")
        notes.append(f"deepspeed ZeRO stage {stage}")
        layers_held = shape.layers
    else:  # megatron: Megatron-LM's theoretical memory, most loaded (first) pipeline stage
        dense = shape.layers * (shape.layer_params - shape.expert_params) + shape.hidden
        emb = shape.embedding_params * (1 if shape.tied or p > 1 else 2)
        ffn = b.ffn
        e_split = (ffn.e * ffn.t) if ffn is not None else (b.e * t)
        shard = (dense / p + emb) / t + shape.layers * shape.expert_params / p / e_split
        # engine_args.distributed_optimizer (rlbatch's megatron engine, off by default): megatron-core's
        # DDP keeps fp32 gradient buffers and its DistributedOptimizer the fp32 main weights and AdamW
        # moments of 1/(d*c) of them: Megatron-LM's 6 + 12/dp bytes per parameter. Off, the engine
        # steps torch AdamW on the bf16 weights: bf16 gradients and moments, 2 + 2 + 4 bytes.
        dist_opt = bool(ea.get("distributed_optimizer", False))
        state = {"params": 2 * shard} if forward_only else (
            {"params": 2 * shard, "grads": 4 * shard, "optimizer": 12 * shard / (d * c)} if dist_opt
            else {"params": 2 * shard, "grads": 2 * shard, "optimizer": 4 * shard})
        if dist_opt and not forward_only:
            notes.append(f"distributed optimizer: optimizer state / {d * c}")
        buffers = 0.0
        layers_held = math.ceil(shape.layers / p)
    # rlbatch's megatron engine runs tensor parallelism with sequence parallelism unless
    # engine_args.sequence_parallel is false: then a layer keeps Korthikanti's 10 + 24/t count,
    # not (34 + ...)/t.
    sp = b.engine == "fsdp" or (b.engine == "megatron" and bool(ea.get("sequence_parallel", True)))
    mb, fmb = train_micro_batch(w, d), logprob_micro_batch(r, w)
    s = w.seq_len / c
    vocab = 1 if r.name in HEADS else shape.vocab  # a value or reward head: a scalar per token
    # Tokens and logit rows per micro-batch: every position of the padded sequences, or with shared
    # prompts each distinct prompt once (logits at its last position) plus the responses.
    ftok, frows, _ = pass_tokens(r, w, fmb, s)
    fwd = {
        "activations": act.forward_working_bytes(shape, ftok / fmb, fmb, e, t),
        "logits": act.logits_bytes(frows, vocab, e, t),
    }
    if buffers:
        fwd["fsdp_buffers" if b.engine == "fsdp" else "gather_buffers"] = buffers * (0.5 if forward_only and b.engine == "fsdp" else 1)
    transient = {"logprobs": fwd}
    if not forward_only:
        recompute = "full" if w.recompute else "none"
        in_flight = min(p, w.grad_accum) if p > 1 else 1  # 1F1B: micro-batches in flight on stage 0
        ttok, trows, _ = pass_tokens(r, w, mb, s)
        st = ttok / mb  # tokens per sequence, prompts shared or not
        acts = layers_held * in_flight * act.layer_bytes(shape, st, mb, e, t, sp=sp, recompute=recompute)
        if recompute == "full":  # the layer being recomputed holds its full activations
            acts += act.layer_bytes(shape, st, mb, e, t, sp=sp)
        train = {"activations": acts, "logits": act.logits_bytes(trows, vocab, e, t, train=True, entropy=w.entropy)}
        if buffers:
            train["fsdp_buffers" if b.engine == "fsdp" else "gather_buffers"] = buffers
        transient["train"] = train
        # Weight sync gathers full tensors one at a time (largest: a layer's worth at most).
        transient["sync"] = {"sync_buffer": e * big_unit / t}
    tensors = math.ceil(shape.tensors / max(1, p))
    return RoleMemory(r.name, state, transient, notes, tensors=tensors)


def infer_engine(r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
    """vllm (``rlbatch.plan.vllm``) and sglang reserve a share of the GPU; hf allocates what the batch needs."""
    assert r.backend is not None
    b = r.backend
    if b.engine == "vllm":
        from rlbatch.plan import vllm

        return vllm.memory(r, shape, w, e, hw)
    tp, pp, engines = b.t, b.p, max(1, b.d)
    weights = e * shape.params / (tp * pp)
    kv_heads_per_gpu = max(1, shape.kv_heads // tp) if tp <= shape.kv_heads else 1  # replicated when t > kv heads
    kv_tok = shape.kv_bytes_per_token(e) / shape.kv_heads * kv_heads_per_gpu / pp
    seqs = math.ceil(w.sequences / engines)
    kv_needed = seqs * w.seq_len * kv_tok
    notes: list[str] = []
    if b.engine in ("vllm", "sglang"):
        key, default = ("gpu_memory_utilization", VLLM_GPU_MEMORY_UTILIZATION) if b.engine == "vllm" else (
            "mem_fraction_static", SGLANG_MEM_FRACTION)
        frac = float(r.engine_args.get(key, default))
        reserve = frac * hw.hbm_bytes
        tokens = int(r.engine_args.get("max_num_batched_tokens", VLLM_MAX_NUM_BATCHED_TOKENS))
        max_seqs = int(r.engine_args.get("max_num_seqs", VLLM_MAX_NUM_SEQS))
        activ = act.forward_working_bytes(shape, tokens, 1, e, tp) + max_seqs * shape.vocab * 4.0
        budget = reserve - weights - activ
        state = {"params": weights, "kv_cache": max(0.0, budget)}
        transient = {"generate": {"activations": activ}, "sync": {}}
        per_seq = w.seq_len * kv_tok
        concurrency = min(seqs, max_seqs, int(max(0.0, budget) // per_seq) if per_seq else seqs)
        if budget <= 0:
            notes.append(f"{key}={frac} leaves no KV cache after {weights / 2**30:.1f} GiB of weights")
        elif concurrency < seqs:
            notes.append(f"KV cache holds {concurrency} of {seqs} sequences per engine: generation runs in waves")
    else:  # hf: up to max_batch sequences per generate call; the KV cache grows with them
        concurrency = min(seqs, hf_max_batch(r.engine_args))
        state = {"params": weights}
        transient = {"generate": {
            "kv_cache": concurrency * w.seq_len * kv_tok,
            "activations": act.forward_working_bytes(shape, w.prompt_len, concurrency, e, tp),
            "logits": concurrency * shape.vocab * 4.0 * 2,  # last-position logits, fp32 processors + probs
        }, "sync": {}}
    return RoleMemory(r.name, state, transient, notes, kv_needed=kv_needed, concurrency=max(concurrency, 0),
                      tensors=math.ceil(shape.tensors / pp))


def role_memory(r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware) -> RoleMemory:
    """State and per-phase transients of one GPU role on its most loaded GPU."""
    assert r.backend is not None
    if r.backend.kind is EngineKind.INFER:
        return infer_engine(r, shape, w, e, hw)
    forward_only = r.name in ("reference", "reward")
    return train_engine(r, shape, w, e, forward_only)
