"""Engine settings that the planner must model exactly as the engines apply them.

Kept free of torch so the planner (which never imports torch) and the engines read one definition.
"""

from __future__ import annotations

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


def hf_max_batch(engine_args: Mapping[str, Any]) -> int:
    return int(engine_args.get("max_batch", HF_MAX_BATCH))


def fsdp_single_unit(fp32_param_bytes: float, engine_args: Mapping[str, Any]) -> bool:
    """Whether the fsdp engine shards a model of this size as one unit."""
    return fp32_param_bytes <= int(engine_args.get("single_unit_max_mb", FSDP_SINGLE_UNIT_MAX_MB)) << 20


def share_prompts(engine_args: Mapping[str, Any]) -> bool:
    """Whether the fsdp engine runs each distinct prompt of a batch once (engine_args.share_prompts,
    on by default; off under activation checkpointing). See ``rlbatch.engines.batch``."""
    return bool(engine_args.get("share_prompts", True))


def worth_sharing(distinct: int, samples: int) -> bool:
    """A shared-prompt batch makes two forward calls instead of one: worth it once prompts repeat
    (at least twice each on average)."""
    return 2 * distinct <= samples
