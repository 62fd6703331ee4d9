"""Fixtures shared by the unit tests."""

from __future__ import annotations

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
    from rlbatch.engines.train import megatron_device

    monkeypatch.setattr(megatron_device, "CPU_SHIM", "megatron_runs_here")
