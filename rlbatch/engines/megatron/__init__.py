"""The ``megatron`` training engine: megatron-core's GPTModel with tensor, pipeline, data, context and
expert parallelism (docs/megatron.md). Its spec and typed engine_args are here; the engine is
``engine`` (``model``, ``convert``, ``optim``, ``device``, ``limits`` beside it), its checks before
start ``rules``, its cost model ``rlbatch.engines.megatron.cost``."""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.engines.defaults import SYNC_BUCKET_MB
from rlbatch.engines.registry import EngineKind, EngineSpec, register


@dataclass(frozen=True)
class MegatronArgs:
    """engine_args of the ``megatron`` training engine (megatron-core GPTModel; docs/megatron.md)."""

    micro_batch: int = 0
    """Sequences per forward (0: the replica's whole share in one pass)."""
    max_tokens_per_micro_batch: int = 0
    """> 0: every pass (log-probs, values, scores, training) in micro-batches of at most this many
    prompt + response tokens (a longer sample alone), every dp rank running as many, at any p;
    training's loss is then exact under any split (the whole mini-batch's aggregation;
    algo.grad_accum unused) and the samples are spread over the dp ranks by tokens, as fsdp's.
    Rows stay right-padded within a micro-batch (its longest sample sets its length) unless
    ``pack_rows``. 0 (the default on every device): grad_accum micro-batches by sample count,
    micro_batch sequences per forward."""
    pack_rows: bool = False
    """With max_tokens_per_micro_batch > 0: each micro-batch's samples back
    to back in one row, megatron-core's 'thd' format (PackedSeqParams), instead of padded rows: no
    compute on padding. Attention is confined to each sample by an exact block-diagonal mask
    through megatron-core's local attention (TransformerEngine's varlen attention, which megatron
    uses for 'thd', is not used here), so its scores grow with the row's length squared: it pays
    where samples are ragged and the budget short; the planner models rows padded."""
    sync_bucket_mb: int = SYNC_BUCKET_MB
    """actor_train: weight sync to a disaggregated actor_infer broadcasts buckets of this size."""
    distributed_optimizer: bool = False
    """megatron-core's DistributedDataParallel and DistributedOptimizer: each data-parallel rank keeps
    the fp32 main weights and AdamW state of 1/d of the parameters (gradients reduce-scattered,
    weights all-gathered). Off: torch AdamW on every rank and one all-reduce of the gradients.
    Trainable roles only (a forward-only role has no optimizer)."""
    sequence_parallel: bool = True
    """At t > 1: megatron-core's sequence parallelism, the activations outside the tensor-parallel
    regions (norms, residuals, the MoE router) split along the sequence over tp: 1/t of their memory,
    all-gather and reduce-scatter in place of all-reduce. Needed to train a Mixture-of-Experts
    model at t > 1. No effect at t = 1."""


# dims "dtpce": tensor, pipeline, data, context (Ulysses, padded rows: rlbatch.engines.megatron.engine)
# and expert parallel (e over d, for Mixture-of-Experts models).
register(EngineSpec("megatron", EngineKind.TRAIN, MegatronArgs, "rlbatch.engines.megatron.engine:MegatronEngine",
                    dims="dtpce", data_axes=("dp",), heads=("lm", "value", "reward"),
                    cost="rlbatch.engines.megatron.cost:MegatronCost", rules="rlbatch.engines.megatron.rules:megatron_problems"))
