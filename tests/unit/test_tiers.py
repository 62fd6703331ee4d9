"""The suite's own tiers (tests/tiers.py): without root and without a running cluster the Slurm
tests are left out with the reason said at the end; the fast tier leaves out the tests marked
``full``; a test without a time limit of its own gets its directory's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiers
from tests.conftest import REPO_ROOT


def test_without_root_and_without_a_cluster_the_slurm_tests_have_a_reason_not_to_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo
    assert "needs root" in str(tiers.slurm_unavailable())
    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\nprintf 'n1 idle\\nn2 down*\\n'\n")
    sinfo.chmod(0o755)
    assert "needs root" in str(tiers.slurm_unavailable())  # one node down: not the dev cluster up
    sinfo.write_text("#!/bin/sh\nprintf 'n1 idle\\nn2 mix\\n'\n")
    assert tiers.slurm_unavailable() is None  # up: a user may run the tests against it
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert tiers.slurm_unavailable() is None  # root starts it (tests/slurm/conftest.py)


def _collect(tmp_path: Path, *args: str) -> str:
    (tmp_path / "test_marks.py").write_text(
        "import pytest\n\n"
        "def test_fast():\n    pass\n\n"
        "@pytest.mark.full\ndef test_curve():\n    pass\n")
    conftest = f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\npytest_plugins = ['tests.tiers']\n"
    (tmp_path / "conftest.py").write_text(conftest)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
                          "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path), *args],
                         capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_the_fast_tier_leaves_out_the_full_tests(tmp_path: Path) -> None:
    out = _collect(tmp_path, "--collect-only", "--tier=fast")
    assert "test_fast" in out and "test_curve" not in out and "1 deselected" in out, out
    out = _collect(tmp_path, "--collect-only")  # --tier=all
    assert "test_fast" in out and "test_curve" in out and "deselected" not in out, out


def test_a_test_without_a_limit_of_its_own_gets_its_directorys() -> None:
    tests = REPO_ROOT / "tests"
    assert tiers.limit_for(tests / "unit" / "test_tiers.py") == tiers.LIMITS["unit"]
    assert tiers.limit_for(tests / "dist" / "test_pipeline.py") == tiers.LIMITS["dist"]
    assert tiers.limit_for(tests / "slurm" / "test_slurm_runtime.py") == tiers.LIMITS["slurm"]
    assert tiers.limit_for(REPO_ROOT / "tools" / "x.py") is None
