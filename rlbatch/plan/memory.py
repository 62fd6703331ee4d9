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
from rlbatch.engines.defaults import (
    MicroBatched,
    max_tokens_per_micro_batch,
)
from rlbatch.engines.registry import EngineKind, spec_of
from rlbatch.models.shape import ModelShape
from rlbatch.plan import activations as act
from rlbatch.plan.costs import cost_of
from rlbatch.plan.layout import RoleLayout
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


def train_micro_batch(w: Workload, dp: int) -> int:
    """Sequences per forward/backward: a rank's share of a mini-batch over grad_accum."""
    return max(1, math.ceil(w.sequences / (w.mini_batches * w.grad_accum * dp)))


def logprob_micro_batch(r: RoleLayout, w: Workload) -> int:
    """Sequences per log-prob forward: engine_args.micro_batch, else the rank's whole share."""
    assert r.backend is not None
    share = max(1, math.ceil(w.sequences / r.backend.d))
    asked = r.args.micro_batch if isinstance(r.args, MicroBatched) else 0
    return min(share, asked or share)


def weight_units(r: RoleLayout, shape: ModelShape) -> int:
    """Units a role's engine gathers its weights in, one collective each (its cost model's)."""
    return cost_of(r.engine).units(r, shape)


def pass_tokens(r: RoleLayout, w: Workload, mb: int, s: float) -> tuple[float, float, int]:
    """(tokens, logit rows, model calls) of one micro-batch of ``mb`` sequences. An engine that
    shares prompts (its cost model's ``shares_prompts``: rlbatch's fsdp engine) runs each distinct
    prompt once with only its last position's logits, then the responses (all but their last token)
    on its cache: two model calls (``rlbatch.engines.batch``); otherwise every sequence runs whole,
    logits at every position."""
    distinct = w.distinct_prompts(mb)
    trained = r.name in TRAINABLE_ROLES  # as the ranks decide which engines train (and recompute)
    if cost_of(r.engine).shares_prompts(r, w, mb, trained):
        suffix = mb * max(w.response_max - 1, 0)
        return distinct * w.prompt_len + suffix, distinct + suffix, 2
    return mb * s, mb * s, 1


CHUNK_BYTES = 1 << 28
"""``rlbatch.algos.core.CHUNK_BYTES`` (kept here: the planner imports no torch; a test checks they
agree): ``chunked_logprobs`` works on this many bytes of fp32 logits at a time."""


def token_budget(r: RoleLayout, hw: Hardware) -> int:
    """The role's token budget as its engine resolves it on ``hw``'s device (0: padded rows): the
    engine_args value, else the device's default (``rlbatch.engines.defaults``). Engines that do
    not pack rows (``EngineSpec.packs_rows``) are modelled padded."""
    if r.backend is None or not spec_of(r.backend.engine).packs_rows:
        return 0
    return max_tokens_per_micro_batch(r.args, "cpu" if hw.is_cpu else "cuda")


def padded_budget(r: RoleLayout) -> int:
    """The token budget of an engine that meets it with padded rows (``EngineSpec.packs_rows``
    false: megatron): engine_args.max_tokens_per_micro_batch (0: micro-batches by count)."""
    if r.backend is None or spec_of(r.backend.engine).packs_rows or not isinstance(r.args, MicroBatched):
        return 0
    return r.args.max_tokens_per_micro_batch or 0


def budget_micro_batch(w: Workload, budget: int, share: int) -> int:
    """Sequences per micro-batch of a padded-row engine under a token ``budget`` (``padded_budget``):
    as many samples of the mean length as fit in the budget (``common.chunks`` counts real tokens),
    at least one, at most the rank's ``share``; each row padded to the longest (``w.seq_len``)."""
    return max(1, min(share, int(budget // max(1.0, w.prompt_len + w.response_mean))))


@dataclass(frozen=True)
class Packing:
    """A rank's pass under a token budget: one unpadded row per micro-batch (``rlbatch.engines.batch.Flat``)."""

    row: float
    """Prompt + response tokens of the largest row: max(longest sample, min(budget, the rank's share))."""
    scored: float
    """LM-head positions of that row: its response tokens, at most the longest sample's share of the row."""
    calls: int
    """Micro-batches (model calls) per pass."""
    tokens: float
    """Decoder positions over the pass: every sample's prompt and response but its last token."""
    head: float
    """LM-head positions over the pass: every response token."""


def packing(w: Workload, budget: int, seqs: int) -> Packing:
    """``seqs`` samples of ``w`` cut into rows of at most ``budget`` tokens (a longer sample alone).
    Rows are bounded by the longest sample (``w.prompt_len + w.response_max``) and sized by the
    mean; the densest row in scored positions is made of the longest samples."""
    longest = w.prompt_len + w.response_max
    share = seqs * (w.prompt_len + w.response_mean)
    row = max(longest, min(float(budget), share))
    calls = max(1, min(seqs, math.ceil(share / budget)))
    return Packing(row, row * w.response_max / longest, calls, seqs * (w.prompt_len + w.response_mean - 1),
                   seqs * w.response_mean)


def adapted(r: RoleLayout, w: Workload) -> bool:
    """Whether ``r`` trains adapters (``model.lora``): the policy's trained role, with a rank."""
    return bool(w.lora_rank) and r.name == "actor_train"


def varlen_rows(e: int) -> bool:
    """Whether packed rows computed in ``e``-byte elements run varlen attention: bf16/fp16 compute
    is a GPU's, where the engines switch to torch's varlen flash kernel
    (``rlbatch.engines.attention``): no mask, attention per sample. fp32 rows keep sdpa's mask."""
    return e < 4


def mask_bytes(row: float, e: int, layers: int) -> float:
    """The attention masks of a packed row under sdpa: transformers' block-diagonal bool [N, N] mask,
    which sdpa converts to an additive mask in the compute dtype in every layer's call, and autograd
    keeps each layer's for the backward (``layers``; 1 in a pass without autograd, one layer at a
    time). Measured: 2 N^2 bytes a layer kept in bf16 on an H100 (under sdpa, before varlen), 4 N^2
    in fp32 on CPU. Rows under varlen attention (``varlen_rows``) have none."""
    return row * row * (1 + e * layers)


def packed_logits_bytes(scored: float, vocab: int, e: int, t: int = 1, train: bool = False,
                        entropy: bool = False) -> float:
    """The vocab-sized tensors of a packed pass (``rlbatch.algos.core.chunked_logprobs``): the
    logits at the scored positions as computed (e bytes; kept for the backward in training), and
    chunks of ``CHUNK_BYTES`` of fp32 logits at a time: the fp32 copy of a chunk (when e < 4) and
    its logsumexp's one temporary (torch exponentiates ``x - max`` in place); training adds the
    logits' gradient (e bytes) and the backward's chunk (exp, its negation, the product with the
    incoming gradient: 3; the entropy term one more). Measured on CPU against
    ``tools/bench/packing.py`` (docs/planner.md)."""
    local = vocab / t
    rows = min(scored, max(1, CHUNK_BYTES // max(1, int(4 * local))))
    chunk = 4.0 * rows * local
    copy = 1 if e < 4 else 0
    if not train:
        return scored * local * e + (1 + copy) * chunk
    return 2 * scored * local * e + (3 + (1 if entropy else 0) + copy) * chunk


def train_engine(r: RoleLayout, shape: ModelShape, w: Workload, e: int, forward_only: bool, budget: int = 0) -> RoleMemory:
    """fsdp / deepspeed / megatron: weights, grads and Adam state by sharding; activations by micro-batch,
    or with a token ``budget`` (``token_budget``) by the largest packed row."""
    assert r.backend is not None
    b = r.backend
    d, t, p, c = b.d, b.t, b.p, b.c
    cost = cost_of(b.engine)
    held = cost.held(r, shape, w, e, forward_only)
    state, layers_held, notes = held.state, held.layers_held, list(held.notes)
    fwd_buffers, train_buffers, step_temp = held.fwd_buffers, held.train_buffers, held.step_temp
    sp = cost.sequence_parallel(r)
    vt = cost.vocab_split(r)  # the logits' split over tp ranks
    mb, fmb = train_micro_batch(w, d), logprob_micro_batch(r, w)
    if pb := padded_budget(r):  # micro-batches cut by tokens, rows padded within each
        mb = budget_micro_batch(w, pb, math.ceil(w.sequences / (w.mini_batches * d)))
        fmb = budget_micro_batch(w, pb, math.ceil(w.sequences / d))
    s = w.seq_len / c
    gathered = c if cost.outputs_over_cp(r) else 1  # logit rows: the whole sequence's on each cp rank
    vocab = 1 if r.name in HEADS else shape.vocab  # a value or reward head: a scalar per token
    # Tokens and logit rows per micro-batch: every position of the padded sequences, or with shared
    # prompts each distinct prompt once (logits at its last position) plus the responses.
    if budget:
        pk = packing(w, budget, math.ceil(w.sequences / d))
        fwd = {
            "activations": act.forward_working_bytes(shape, pk.row, 1, e, t),
            "logits": packed_logits_bytes(pk.scored, vocab, e, vt) if vocab > 1 else e * pk.row,
        }
        if not varlen_rows(e):
            fwd["attention_mask"] = mask_bytes(pk.row, e, 1)
        notes.append(f"{r.name}: token budget {budget}, log-prob rows of up to {pk.row:.0f} tokens ({pk.scored:.0f} scored)")
    else:
        ftok, frows, _ = pass_tokens(r, w, fmb, s)
        frows *= gathered
        fwd = {
            "activations": act.forward_working_bytes(shape, ftok / fmb, fmb, e, t),
            "logits": act.logits_bytes(frows, vocab, e, vt),
        }
    if fwd_buffers:
        fwd[held.buffer_term] = fwd_buffers
    transient = {"logprobs": fwd}
    if not forward_only:
        recompute = "full" if w.recompute else "none"
        in_flight = min(p, w.grad_accum) if p > 1 else 1  # 1F1B: micro-batches in flight on stage 0
        if budget:  # one row of the rank's share of a mini-batch, at most the budget
            tp = packing(w, budget, math.ceil(w.sequences / (w.mini_batches * d)))
            st, mb = tp.row, 1
            logits = packed_logits_bytes(tp.scored, vocab, e, vt, train=True, entropy=w.entropy) if vocab > 1 else 2 * e * tp.row
        else:
            ttok, trows, _ = pass_tokens(r, w, mb, s)
            st = ttok / mb  # tokens per sequence, prompts shared or not
            logits = act.logits_bytes(trows * gathered, vocab, e, vt, train=True, entropy=w.entropy)
        acts = layers_held * in_flight * act.layer_bytes(shape, st, mb, e, t, sp=sp, recompute=recompute)
        if recompute == "full":  # the layer being recomputed holds its full activations
            acts += act.layer_bytes(shape, st, mb, e, t, sp=sp)
        train = {"activations": acts, "logits": logits}
        if budget and not varlen_rows(e):  # every layer's additive mask for the backward; recomputed: the one layer's
            train["attention_mask"] = mask_bytes(st, e, 1 if recompute == "full" else layers_held)
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
        m = train_engine(r, shape, w, e, forward_only=r.name not in TRAINABLE_ROLES, budget=token_budget(r, hw))
    m.load = load_bytes(r, shape, e, hw)
    return m
