"""Every test here needs the two-node Slurm test cluster (slurm/dev-cluster.sh; `make test` starts it)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO_ROOT


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    status = subprocess.run(["bash", str(REPO_ROOT / "slurm" / "dev-cluster.sh"), "status"], capture_output=True, text=True)
    assert status.returncode == 0, f"the Slurm test cluster is not up; start it with slurm/dev-cluster.sh start\n{status.stdout}"
