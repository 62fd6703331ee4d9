"""rlbatch installed from a wheel (not editable) runs: the configs travel inside the package.

The wheel is built from a copy of only what a source distribution holds (pyproject.toml,
README.md, rlbatch/), installed with ``pip install --target`` and run with this venv's python
from a directory outside the repository, with PYTHONPATH naming the install alone. A file the
program reads at run time but the wheel does not ship (rlbatch/conf/) makes it fail here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.dist


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding rlbatch installed from its wheel, and nothing else."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    shutil.copytree(REPO_ROOT / "rlbatch", src / "rlbatch", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # No build isolation: the venv's setuptools builds it, so the test needs no network.
    built = run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "wheel"), str(src)], root)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (root / "wheel").glob("rlbatch-*.whl")
    site = root / "site"
    done = run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return site


@pytest.fixture
def env(installed: Path) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(installed)}


def test_the_installed_copy_is_the_one_imported(installed: Path, env: dict[str, str], tmp_path: Path) -> None:
    out = run([sys.executable, "-c", "import rlbatch; print(rlbatch.__file__)"], tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == installed / "rlbatch" / "__init__.py"
    assert (installed / "rlbatch" / "conf" / "config.yaml").is_file()


def test_installed_rlbatch_dry_runs_and_trains_two_steps(installed: Path, env: dict[str, str], tmp_path: Path) -> None:
    dry = run([sys.executable, "-m", "rlbatch.launch", "dry_run=true"], tmp_path, env)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    assert "Slurm request" in dry.stdout and "command: " in dry.stdout
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing

    run_dir = tmp_path / "run"
    out = run([sys.executable, "-m", "rlbatch.launch", "steps=2", f"run_dir={run_dir}",
               "algo.prompts_per_step=8", "algo.samples_per_prompt=4"], tmp_path, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
