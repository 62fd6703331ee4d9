"""Every test here needs the two-node Slurm test cluster (slurm/dev-cluster.sh; `make test` starts it).

A job a test leaves behind (its launcher timed out or was killed) would hold the cluster's nodes
and starve every later test: each test's jobs are cancelled when it ends, and jobs left by an
earlier run of this checkout are cancelled before the first test."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, RUNS_ROOT, run_root_of


def jobs_under(root: Path) -> list[str]:
    """Ids of the queued or running jobs whose working directory is ``root`` or below it."""
    out = subprocess.run(["squeue", "--noheader", "--format=%i %Z"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    prefix = str(root).rstrip("/") + "/"
    jobs = []
    for line in out.stdout.splitlines():
        job, _, workdir = line.strip().partition(" ")
        if (workdir.rstrip("/") + "/").startswith(prefix):
            jobs.append(job)
    return jobs


def cancel_jobs_under(root: Path) -> None:
    if jobs := jobs_under(root):
        subprocess.run(["scancel", *jobs], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    status = subprocess.run(["bash", str(REPO_ROOT / "slurm" / "dev-cluster.sh"), "status"], capture_output=True, text=True)
    assert status.returncode == 0, f"the Slurm test cluster is not up; start it with slurm/dev-cluster.sh start\n{status.stdout}"
    cancel_jobs_under(RUNS_ROOT)


@pytest.fixture(autouse=True)
def cancel_left_jobs(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    cancel_jobs_under(run_root_of(request.node))
