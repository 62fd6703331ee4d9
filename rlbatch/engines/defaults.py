"""Engine settings that the planner must model exactly as the engines apply them.

Kept free of torch so the planner (which never imports torch) and the engines read one
definition: the engines' typed engine_args (``rlbatch/engines/<name>/__init__.py``) take their
defaults from here, below every engine; the functions take those typed args (the planner's
``RoleLayout.args``, an engine's ``EngineContext.args``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

HF_MAX_BATCH = 1024
"""The hf engine generates at most this many sequences per call (engine_args.max_batch)."""

FSDP_SINGLE_UNIT_MAX_MB = 64
"""The fsdp engine makes a model of up to this many MB of fp32 parameters one FSDP unit (one
all-gather forward, one reduce-scatter backward per micro-batch); a larger one gets a unit per
decoder layer, so only one layer is ever unsharded. Small models gain nothing from per-layer
units but pay per-collective latency for each (on CPU with gloo about 2.7 ms each: most of a d2
step of the tiny model). engine_args.single_unit_max_mb overrides it."""


def fsdp_single_unit(fp32_param_bytes: float, single_unit_max_mb: int) -> bool:
    """Whether the fsdp engine shards a model of this size as one unit (engine_args.single_unit_max_mb)."""
    return fp32_param_bytes <= single_unit_max_mb << 20


SYNC_BUCKET_MB = 256
"""A training engine streams its weights to the inference engines in buckets of this many MB
(engine_args.sync_bucket_mb)."""


@runtime_checkable
class SyncBuckets(Protocol):
    """The typed engine_args of a training engine that sets its weight sync's bucket size."""

    @property
    def sync_bucket_mb(self) -> int: ...


@runtime_checkable
class MicroBatched(Protocol):
    """The typed engine_args of a training engine that cuts its passes into micro-batches (fsdp,
    deepspeed, megatron): sequences per micro-batch and the token budget of one."""

    @property
    def micro_batch(self) -> int: ...

    @property
    def max_tokens_per_micro_batch(self) -> int | None: ...


GPU_MAX_TOKENS_PER_MICRO_BATCH = 4096
"""The token budget of a training engine's micro-batches on a GPU when engine_args leave
max_tokens_per_micro_batch unset. Packed rows beat padded ones there on ragged batches of real
lengths (docs/benchmarks.md "Packing": 1.6-2.9x, log-prob peak memory 5-9x lower on an H100 at
budgets of 900-4300 tokens, shared-prompt GRPO groups included). A row's attention is torch's
varlen flash kernel there (``rlbatch.engines.attention``), so the budget is bounded by memory, not
by attention: 4096 keeps a 7B model's rows within an 80 GB GPU on fsdp:d4 where 8192 does not
(``python -m rlbatch.plan``), at the price of more micro-batches for small models, which the host's
per-micro-batch work then bounds (docs/benchmarks.md "GPU"); ``plan search`` picks a budget per model.
A row holds fewer tokens than the budget only at the end of a rank's share; a longer sample runs alone."""


def max_tokens_per_micro_batch(engine_args: object, device_type: str) -> int:
    """The token budget of a training engine's micro-batches on a ``device_type`` ('cuda', 'cpu')
    device (typed engine_args of any engine; 0 for one without token budgets):
    engine_args.max_tokens_per_micro_batch when set (0: padded rows), else packed with
    ``GPU_MAX_TOKENS_PER_MICRO_BATCH`` on a GPU and padded on the CPU, where the dense [N, N] mask
    makes attention over a packed row cost more than padding does on short samples, and padded rows
    with shared prompts were faster on the default experiment (docs/benchmarks.md "Packing")."""
    if not isinstance(engine_args, MicroBatched):
        return 0  # an engine without token budgets
    value = engine_args.max_tokens_per_micro_batch
    if value is not None:
        return int(value)
    return GPU_MAX_TOKENS_PER_MICRO_BATCH if device_type == "cuda" else 0


def worth_sharing(distinct: int, samples: int) -> bool:
    """A shared-prompt batch makes two forward calls instead of one: worth it once prompts repeat
    (at least twice each on average)."""
    return 2 * distinct <= samples
