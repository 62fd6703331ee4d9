"""The ``fsdp`` training engine: FSDP2 over the role's data-parallel ranks, DTensor tensor parallelism
(``tp``) and Ulysses context parallelism (``rlbatch.engines.ulysses``), alone or together. Its spec and
typed engine_args are here; the engine is ``engine``, its checks before start ``rules``, its cost
model ``rlbatch.engines.fsdp.cost``."""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.engines.defaults import FSDP_SINGLE_UNIT_MAX_MB, SYNC_BUCKET_MB
from rlbatch.engines.registry import EngineKind, EngineSpec, register


@dataclass(frozen=True)
class FSDPArgs:
    """engine_args of the ``fsdp`` engine (training and forward-only roles)."""

    micro_batch: int = 0
    """Sequences per log-prob forward (0: the rank's whole share in one pass)."""
    share_prompts: bool = True
    """Run each distinct prompt of a micro-batch once and its responses on its KV cache (same
    log-probs and gradients, less compute for GRPO groups); off under activation checkpointing."""
    max_tokens_per_micro_batch: int | None = None
    """> 0: each micro-batch runs without padding, its samples concatenated into one row with
    attention confined to each sample, the LM head only at the positions that score a response
    token, log-probs and entropy computed in chunks (no fp32 copy of the logits kept for the
    backward; a reward model's score read at each sample's last token); share_prompts is then not
    used. Micro-batches hold at most this many prompt + response tokens (a longer sample alone),
    every dp rank running as many; training's loss is then exact under any split (the whole
    mini-batch's aggregation; algo.grad_accum unused) and the samples are spread over the dp ranks
    by tokens (docs/algorithms.md). 0: padded rows, grad_accum micro-batches by sample count.
    Unset: the device's default (``rlbatch.engines.defaults.max_tokens_per_micro_batch``): packed
    with a budget of 4096 tokens on a GPU, padded on the CPU."""
    single_unit_max_mb: int = FSDP_SINGLE_UNIT_MAX_MB
    """A model of up to this many MB of fp32 parameters is one FSDP unit (one all-gather per
    pass); a larger one gets a unit per decoder layer."""
    sync_bucket_mb: int = SYNC_BUCKET_MB
    """actor_train: weight sync to a disaggregated actor_infer broadcasts buckets of this size."""


# dims "dtc": FSDP2 over dp, DTensor tensor parallelism over tp (rlbatch.engines.fsdp.tp) or
# Ulysses context parallelism over cp (rlbatch.engines.ulysses), alone or together (c splits each tp rank's heads).
register(EngineSpec("fsdp", EngineKind.TRAIN, FSDPArgs, "rlbatch.engines.fsdp.engine:FSDPEngine", dims="dtc",
                    heads=("lm", "value", "reward"), packs_rows=True, trains_adapters=True,
                    cost="rlbatch.engines.fsdp.cost:FSDPCost", rules="rlbatch.engines.fsdp.rules:fsdp_problems"))
