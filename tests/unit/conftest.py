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
