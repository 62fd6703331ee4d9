"""Shared test setup: the repository is importable here and in the subprocesses tests start."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

pytest_plugins = ["tests.tiers"]  # the two tiers, the Slurm tests' cluster, per-test time limits


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for ``sys.executable -m rlbatch.launch`` run from another directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


STAND_INS = REPO_ROOT / "tests" / "stand_ins"
"""Stand-ins for the CUDA-only modules SGLang's CPU engine imports (docs/sglang.md)."""


def sglang_env() -> dict[str, str]:
    """``launch``'s env for a run with an sglang engine on CPU: its processes (and SGLang's own) load
    the stand-ins at start."""
    return {"PYTHONPATH": os.pathsep.join([str(STAND_INS), str(REPO_ROOT)])}


RUNS_ROOT = REPO_ROOT / ".test-runs"
"""Run directories of tests that start real processes. Not under /tmp: the Slurm test cluster
gives each node a private /tmp, so job files there would not be shared."""


def run_root_of(node: pytest.Item) -> Path:
    """The directory ``run_root`` gives ``node``'s test."""
    return RUNS_ROOT / node.name.replace("/", "_").replace("[", "-").replace("]", "")


@pytest.fixture
def run_root(request: pytest.FixtureRequest) -> Path:
    """A fresh, shared-filesystem directory for this test's runs."""
    import shutil

    path = run_root_of(request.node)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def rank_logs(run_dir: Path) -> str:
    """Every rank's log of a launched run (``<run_dir>/logs/rank*.log``), concatenated."""
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank*.log")))


def launch(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    """Run ``python -m rlbatch.launch <args>``; returns the CompletedProcess (text output)."""
    import subprocess

    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [full_env.get("PYTHONPATH")])])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "rlbatch.launch", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
