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

from rlbatch.config.hardware import Hardware
from rlbatch.config.schema import HEADS, TRAINABLE_ROLES
from rlbatch.engines.registry import EngineKind
from rlbatch.models.shape import ModelShape
from rlbatch.plan import activations as act
from rlbatch.plan.costs import cost_of
from rlbatch.plan.layout import RoleLayout
from rlbatch.plan.passes import adapted, cut, varlen_rows
from rlbatch.plan.workload import Workload

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
    load: float = 0.0
    """Host bytes the engine needs beyond its state while it is built (weights read from the
    files or drawn, or a whole model built on the host before it is sharded or moved)."""


def compute_bytes(model_dtype: str, hw: Hardware) -> int:
    """Bytes per element of weights and activations: 'auto' is bf16 on GPUs, fp32 on CPUs."""
    if model_dtype in ("bf16", "fp16"):
        return 2
    if model_dtype == "fp32":
        return 4
    return 4 if hw.is_cpu else 2


RANDOM_INIT_BLOCK = float(1 << 22)
"""A random-init tensor is drawn in blocks of 2**20 fp32 elements (``rlbatch.models.weights``)."""


def largest_tensor(shape: ModelShape) -> float:
    """Elements of the largest parameter tensor: the embedding, an MLP matrix, or a layer's stacked
    routed experts (gate and up of every expert: one tensor in transformers)."""
    return float(max(shape.largest_module_params, 2 * shape.experts * shape.moe_ffn * shape.hidden))


def load_bytes(r: RoleLayout, shape: ModelShape, e: int, hw: Hardware) -> float:
    """Host bytes beyond its state while a role's engine is built (its cost model's ``load_bytes``:
    0 where not modelled)."""
    return cost_of(r.engine).load_bytes(r, shape, e, hw)


def frozen_tower(r: RoleLayout, shape: ModelShape, w: Workload, state: dict[str, float], notes: list[str],
                 forward_only: bool) -> None:
    """A vision-language model trained with its vision tower frozen (``model.train_vision=false``,
    the default): the tower's parameters are held but get no gradients and no optimizer state, so
    the engine's full-model grads and optimizer terms shrink by its share (in place)."""
    if forward_only or not shape.vision_params or w.train_vision or adapted(r, w):
        return
    keep = 1.0 - shape.vision_params / shape.params
    for kind in ("grads", "optimizer"):
        if kind in state:
            state[kind] *= keep
    notes.append(f"{r.name}: vision tower frozen: {shape.vision_params / 1e6:.1f}M of {shape.params / 1e6:.1f}M "
                 f"parameters get no gradients or optimizer state")


def train_engine(r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware, forward_only: bool) -> RoleMemory:
    """fsdp / deepspeed / megatron: weights, grads and Adam state by sharding; activations by
    micro-batch, or under a token budget by the largest packed row (the passes' ``Cut``)."""
    assert r.backend is not None
    b = r.backend
    t, p, c = b.t, b.p, b.c
    cost = cost_of(b.engine)
    held = cost.held(r, shape, w, e, forward_only)
    state, layers_held, notes = held.state, held.layers_held, list(held.notes)
    frozen_tower(r, shape, w, state, notes, forward_only)
    fwd_buffers, train_buffers, step_temp = held.fwd_buffers, held.train_buffers, held.step_temp
    sp = cost.sequence_parallel(r)
    vt = cost.vocab_split(r)  # the logits' split over tp ranks
    gathered = c if cost.outputs_over_cp(r) else 1  # logit rows: the whole sequence's on each cp rank
    vocab = 1 if r.name in HEADS else shape.vocab  # a value or reward head: a scalar per token
    # Tokens and logit rows per micro-batch: every position of the padded sequences, or with shared
    # prompts each distinct prompt once (logits at its last position) plus the responses.
    fc = cut(r, w, hw, train=False)
    if (pk := fc.packed) is not None:
        fwd = {
            "activations": act.forward_working_bytes(shape, pk.row, 1, e, t),
            "logits": act.packed_logits_bytes(pk.scored, vocab, e, vt) if vocab > 1 else e * pk.row,
        }
        if not varlen_rows(e):
            fwd["attention_mask"] = act.mask_bytes(pk.row, e, 1)
        notes.append(f"{r.name}: token budget {fc.budget}, log-prob rows of up to {pk.row:.0f} tokens "
                     f"({pk.scored:.0f} scored)")
    else:
        fwd = {
            "activations": act.forward_working_bytes(shape, fc.tokens / fc.micro, fc.micro, e, t),
            "logits": act.logits_bytes(fc.rows * gathered, vocab, e, vt),
        }
    if fwd_buffers:
        fwd[held.buffer_term] = fwd_buffers
    transient = {"logprobs": fwd}
    if not forward_only:
        recompute = "full" if w.recompute else "none"
        in_flight = min(p, w.grad_accum) if p > 1 else 1  # 1F1B: micro-batches in flight on stage 0
        tc = cut(r, w, hw, train=True)
        if (tp := tc.packed) is not None:  # one row of the rank's share of a mini-batch, at most the budget
            st, mb = tp.row, 1
            logits = (act.packed_logits_bytes(tp.scored, vocab, e, vt, train=True, entropy=w.entropy) if vocab > 1
                      else 2 * e * tp.row)
        else:
            st, mb = tc.tokens / tc.micro, tc.micro  # tokens per sequence, prompts shared or not
            logits = act.logits_bytes(tc.rows * gathered, vocab, e, vt, train=True, entropy=w.entropy)
        acts = layers_held * in_flight * act.layer_bytes(shape, st, mb, e, t, sp=sp, recompute=recompute)
        if recompute == "full":  # the layer being recomputed holds its full activations
            acts += act.layer_bytes(shape, st, mb, e, t, sp=sp)
        train = {"activations": acts, "logits": logits}
        if tc.packed is not None and not varlen_rows(e):  # every layer's additive mask for the backward; recomputed: the one layer's
            train["attention_mask"] = act.mask_bytes(st, e, 1 if recompute == "full" else layers_held)
        if train_buffers:
            train[held.buffer_term] = train_buffers
        if step_temp > sum(train.values()):  # the step runs after the passes' transients are freed
            train["optimizer_step"] = step_temp - sum(train.values())
        transient["train"] = train
        transient["sync"] = {"sync_buffer": held.sync_bytes}
    tensors = math.ceil(shape.tensors / max(1, p))
    return RoleMemory(r.name, state, transient, notes, tensors=tensors)


@dataclass(frozen=True)
class Reservation:
    """An inference engine that reserves a share of the GPU when it starts (SGLang's
    mem_fraction_static) for weights, activations and KV cache: its role's engine_args."""

    fraction_key: str
    """The engine_args key of the share (for the notes)."""
    fraction: float
    batched_tokens: int
    """Tokens of the forward it profiles activations for (engine_args.max_num_batched_tokens)."""
    seqs: int
    """Sequences decoded together at most (engine_args.max_num_seqs): their fp32 logits are kept free too."""


@dataclass(frozen=True)
class PerCall:
    """An inference engine that allocates what each generate call needs (hf), up to ``max_batch``
    sequences a call (engine_args.max_batch), the KV cache growing with them."""

    max_batch: int


def generic_infer_memory(r: RoleLayout, shape: ModelShape, w: Workload, e: int, hw: Hardware,
                         allocation: Reservation | PerCall) -> RoleMemory:
    """An inference engine's state and transients, as it allocates its memory (``Reservation`` or
    ``PerCall``). vLLM has a model of its own (``rlbatch.engines.vllm.cost``)."""
    assert r.backend is not None
    b = r.backend
    tp, pp, engines = b.t, b.p, max(1, b.d)
    weights = e * shape.params / (tp * pp)
    kv_heads_per_gpu = max(1, shape.kv_heads // tp) if tp <= shape.kv_heads else 1  # replicated when t > kv heads
    kv_tok = shape.kv_bytes_per_token(e) / shape.kv_heads * kv_heads_per_gpu / pp
    seqs = math.ceil(w.sequences / engines)
    kv_needed = seqs * w.seq_len * kv_tok
    notes: list[str] = []
    if isinstance(allocation, Reservation):
        key, frac = allocation.fraction_key, allocation.fraction
        tokens, max_seqs = allocation.batched_tokens, allocation.seqs
        activ = act.forward_working_bytes(shape, tokens, 1, e, tp) + max_seqs * shape.vocab * 4.0
        budget = frac * hw.hbm_bytes - weights - activ
        state = {"params": weights, "kv_cache": max(0.0, budget)}
        transient = {"generate": {"activations": activ}, "sync": {}}
        per_seq = w.seq_len * kv_tok
        concurrency = min(seqs, max_seqs, int(max(0.0, budget) // per_seq) if per_seq else seqs)
        if budget <= 0:
            notes.append(f"{key}={frac} leaves no KV cache after {weights / 2**30:.1f} GiB of weights")
        elif concurrency < seqs:
            notes.append(f"KV cache holds {concurrency} of {seqs} sequences per engine: generation runs in waves")
    else:  # hf: up to max_batch sequences per generate call; the KV cache grows with them
        concurrency = min(seqs, allocation.max_batch)
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
        m = cost_of(r.engine).infer_memory(r, shape, w, e, hw)
    else:
        m = train_engine(r, shape, w, e, hw, forward_only=r.name not in TRAINABLE_ROLES)
    m.load = load_bytes(r, shape, e, hw)
    return m
