"""Fixtures shared by the unit tests."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.configs import default_config


@pytest.fixture
def cfg(tmp_path: Path) -> dict[str, Any]:
    """The default experiment as a plain dict, with its run directory under tmp_path."""
    return default_config(tmp_path / "run")


@pytest.fixture
def megatron_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation as on a machine where the megatron engine runs (a GPU, or its CPU shim installed):
    its layout rules alone, without the refusal of CPU ranks (``megatron_device.needs_cuda``)."""
    from rlbatch.engines.megatron import device as megatron_device

    monkeypatch.setattr(megatron_device, "CPU_SHIM", "megatron_runs_here")


@pytest.fixture
def one_rank_mesh() -> Iterator[Any]:
    """A one-rank gloo world in this process and its data-parallel mesh: an engine built on it runs
    as on one rank of a run."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield DeviceMesh("cpu", torch.arange(1), mesh_dim_names=("dp",))
        finally:
            dist.destroy_process_group()
