"""Helpers for the planner tests: configs as plain dicts, placed by place() (no Hydra, no torch)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from rlbatch.config.hardware import Hardware, load_hardware
from rlbatch.config.parse import parse
from rlbatch.config.schema import RLBatchConfig
from rlbatch.placement import place
from rlbatch.plan.layout import Layout, from_placement
from rlbatch.plan.workload import Workload, workload_from_config

MODELS = Path(__file__).parent / "models"
"""config.json files of published models (copied from their Hugging Face repositories)."""


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def make_config(**over: Any) -> dict[str, Any]:
    """The schema's defaults (the default experiment) with nested overrides."""
    return merge(dataclasses.asdict(RLBatchConfig()), over)


def workload_of(cfg: dict[str, Any], *args: Any, **kwargs: Any) -> Workload:
    """``workload_from_config`` of a plain config (read by the parse, as a run's config is)."""
    return workload_from_config(parse(cfg).config, *args, **kwargs)


def make_layout(cfg: dict[str, Any]) -> Layout:
    return from_placement(place(cfg), int(cfg["cluster"].get("cpus_per_task") or 1))


def roles(train: str, infer: str, train_ranks: list[int] | str, infer_ranks: list[int] | str,
          micro_batch: int = 0, max_tokens: int | None = 0, **extra: Any) -> dict[str, Any]:
    """A roles mapping: reference on actor_train's ranks with its backend. ``micro_batch`` bounds
    the sequences of one log-prob forward (rlbatch's fsdp engine otherwise takes a rank's whole share).
    ``max_tokens``: the training engines' engine_args.max_tokens_per_micro_batch, 0 (padded rows)
    unless told; None leaves it unset (the device's default: packed on a GPU)."""
    args: dict[str, Any] = {"engine_args": {"micro_batch": micro_batch}} if micro_batch else {"engine_args": {}}
    if max_tokens is not None and train.split(":")[0] in ("fsdp", "deepspeed"):  # the engines with the option
        args["engine_args"]["max_tokens_per_micro_batch"] = max_tokens
    out = {
        "actor_train": {"device_mapping": train_ranks, "backend": train, **args},
        "actor_infer": {"device_mapping": infer_ranks, "backend": infer},
        "reference": {"device_mapping": train_ranks, "backend": "", **args},
        "critic": {"enabled": False},
        "reward": {"world_size": 1},
    }
    return merge(out, extra)


@pytest.fixture
def h100() -> Hardware:
    return load_hardware("h100_sxm")


@pytest.fixture
def cpu_hw() -> Hardware:
    return load_hardware("cpu")
