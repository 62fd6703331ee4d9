"""How a role's passes over its rank's share are cut into model calls (``cut``): sequences per
micro-batch, token budgets and packed rows, prompts shared or not. The memory model
(``plan/memory.py``) sizes a pass's transients from its ``Cut``, the time model (``plan/timing.py``)
times the same ``Cut``; it reads the workload, the role's typed engine_args and its engine's cost
model, and calls neither of them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlbatch.config.hardware import Hardware
from rlbatch.config.schema import TRAINABLE_ROLES
from rlbatch.engines.defaults import MicroBatched, max_tokens_per_micro_batch
from rlbatch.engines.registry import spec_of
from rlbatch.plan.costs import cost_of
from rlbatch.plan.layout import RoleLayout
from rlbatch.plan.workload import Workload


def train_micro_batch(w: Workload, dp: int) -> int:
    """Sequences per forward/backward: a rank's share of a mini-batch over grad_accum."""
    return max(1, math.ceil(w.sequences / (w.mini_batches * w.grad_accum * dp)))


def logprob_micro_batch(r: RoleLayout, w: Workload) -> int:
    """Sequences per log-prob forward: engine_args.micro_batch, else the rank's whole share."""
    assert r.backend is not None
    share = max(1, math.ceil(w.sequences / r.backend.d))
    asked = r.args.micro_batch if isinstance(r.args, MicroBatched) else 0
    return min(share, asked or share)


def pass_tokens(r: RoleLayout, w: Workload, mb: int, s: float) -> tuple[float, float, int]:
    """(tokens, logit rows, model calls) of one micro-batch of ``mb`` sequences. An engine that
    shares prompts (its cost model's ``shares_prompts``: rlbatch's fsdp engine) runs each distinct
    prompt once with only its last position's logits, then the responses (all but their last token)
    on its cache: two model calls (``rlbatch.engines.batch``); otherwise every sequence runs whole,
    logits at every position. Prompts with images are never shared (their multimodal positions)."""
    distinct = w.distinct_prompts(mb)
    trained = r.name in TRAINABLE_ROLES  # as the ranks decide which engines train (and recompute)
    if not w.image_tokens and cost_of(r.engine).shares_prompts(r, w, mb, trained):
        suffix = mb * max(w.response_max - 1, 0)
        return distinct * w.prompt_len + suffix, distinct + suffix, 2
    return mb * s, mb * s, 1


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


@dataclass(frozen=True)
class Cut:
    """One pass of a role over its busiest rank's share of the step: a log-prob pass, or one epoch
    of training over the mini-batches, cut into model calls as its engine cuts it."""

    train: bool
    seqs: int
    """The rank's share of the step's sequences."""
    updates: int
    """Parts the share is trained in, an optimizer step each (the mini-batches; 1 for a log-prob pass)."""
    micro: int
    """Sequences per micro-batch of padded rows (``micro_batch``, the rank's share, or what a padded
    token budget holds)."""
    padded_budget: int
    """A padded-row engine's token budget that cut ``micro`` (0: cut by count)."""
    budget: int
    """A packing engine's token budget (``token_budget``; 0: padded rows)."""
    packed: Packing | None
    """Under ``budget``: one update's share in packed rows; None: padded rows."""
    tokens: float
    """Decoder positions of one padded micro-batch (``pass_tokens``)."""
    rows: float
    """Logit rows of one padded micro-batch."""
    models: int
    """Model calls of one padded micro-batch (2 with shared prompts)."""


def cut(r: RoleLayout, w: Workload, hw: Hardware, train: bool) -> Cut:
    """How ``r``'s engine cuts a log-prob pass (``train`` false) or a training epoch of ``w`` on ``hw``."""
    b = r.backend
    assert b is not None
    seqs = math.ceil(w.sequences / b.d)
    updates = w.mini_batches if train else 1
    budget = token_budget(r, hw)
    micro = train_micro_batch(w, b.d) if train else logprob_micro_batch(r, w)
    if pb := padded_budget(r):  # micro-batches cut by tokens, rows padded within each
        micro = budget_micro_batch(w, pb, math.ceil(seqs / updates))
    tokens, rows, models = pass_tokens(r, w, micro, w.seq_len / b.c)
    return Cut(train, seqs, updates, micro, pb, budget,
               packing(w, budget, math.ceil(seqs / updates)) if budget else None, tokens, rows, models)
