"""Engine settings that the planner must model exactly as the engines apply them.

Kept free of torch so the planner (which never imports torch) and the engines read one
definition: the engines' typed engine_args (``rlbatch/engines/<name>/__init__.py``) take their
defaults from here, below every engine; each function takes a role's engine_args as the raw
mapping (planner) or the typed dataclass (engines).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

HF_MAX_BATCH = 1024
"""The hf engine generates at most this many sequences per call (engine_args.max_batch)."""

FSDP_SINGLE_UNIT_MAX_MB = 64
"""The fsdp engine makes a model of up to this many MB of fp32 parameters one FSDP unit (one
all-gather forward, one reduce-scatter backward per micro-batch); a larger one gets a unit per
decoder layer, so only one layer is ever unsharded. Small models gain nothing from per-layer
units but pay per-collective latency for each (on CPU with gloo about 2.7 ms each: most of a d2
step of the tiny model). engine_args.single_unit_max_mb overrides it."""


def _get(engine_args: Any, key: str, default: Any) -> Any:
    if dataclasses.is_dataclass(engine_args):
        return getattr(engine_args, key, default)
    assert isinstance(engine_args, Mapping)
    return engine_args.get(key, default)


def hf_max_batch(engine_args: Any) -> int:
    return int(_get(engine_args, "max_batch", HF_MAX_BATCH))


def fsdp_single_unit(fp32_param_bytes: float, engine_args: Any) -> bool:
    """Whether the fsdp engine shards a model of this size as one unit."""
    return fp32_param_bytes <= int(_get(engine_args, "single_unit_max_mb", FSDP_SINGLE_UNIT_MAX_MB)) << 20


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


def max_tokens_per_micro_batch(engine_args: Any, device_type: str) -> int:
    """The token budget of a training engine's micro-batches on a ``device_type`` ('cuda', 'cpu')
    device (typed engine_args of any engine; a raw mapping only of an engine with token budgets):
    engine_args.max_tokens_per_micro_batch when set (0: padded rows), else packed with
    ``GPU_MAX_TOKENS_PER_MICRO_BATCH`` on a GPU and padded on the CPU, where the dense [N, N] mask
    makes attention over a packed row cost more than padding does on short samples, and padded rows
    with shared prompts were faster on the default experiment (docs/benchmarks.md "Packing")."""
    if dataclasses.is_dataclass(engine_args) and not hasattr(engine_args, "max_tokens_per_micro_batch"):
        return 0  # an engine without token budgets
    value = _get(engine_args, "max_tokens_per_micro_batch", None)
    if value is not None:
        return int(value)
    return GPU_MAX_TOKENS_PER_MICRO_BATCH if device_type == "cuda" else 0


def share_prompts(engine_args: Any) -> bool:
    """Whether the fsdp engine runs each distinct prompt of a batch once (engine_args.share_prompts,
    on by default; off under activation checkpointing). See ``rlbatch.engines.batch``."""
    return bool(_get(engine_args, "share_prompts", True))


def worth_sharing(distinct: int, samples: int) -> bool:
    """A shared-prompt batch makes two forward calls instead of one: worth it once prompts repeat
    (at least twice each on average)."""
    return 2 * distinct <= samples
