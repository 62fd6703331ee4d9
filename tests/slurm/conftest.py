"""Every test here needs the two-node Slurm test cluster (slurm/dev-cluster.sh): the first of them to
run starts it (as root; tests/tiers.py keeps them from running where it cannot be started).

A job a test leaves behind (its launcher timed out or was killed) would hold the cluster's nodes
and starve every later test: each test's jobs are cancelled when it ends, and jobs left by an
earlier run of this checkout are cancelled before the first test."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def dev_cluster() -> None:
    """The cluster up: started here when it is not (a no-op when it is), its failure shown whole.
    Without root, tests/tiers.py let these tests run only because the cluster is up already."""
    if os.geteuid() != 0:
        return
    start = subprocess.run(["bash", str(REPO_ROOT / "slurm" / "dev-cluster.sh"), "start"], capture_output=True,
                           text=True, timeout=900)
    assert start.returncode == 0, f"the Slurm test cluster did not start:\n{start.stdout}\n{start.stderr}"


@pytest.fixture(scope="module", autouse=True)
def cluster(dev_cluster: None) -> None:
    cancel_jobs_under(RUNS_ROOT)


@pytest.fixture(autouse=True)
def cancel_left_jobs(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    cancel_jobs_under(run_root_of(request.node))
