"""``tools/gpu_check.sh`` without launching a run: its arguments, and what it reports and returns
when a step fails (the steps that depend on it do not run, and say so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "tools" / "gpu_check.sh"


def _check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def test_gpu_check_refuses_unknown_steps_and_arguments() -> None:
    for args, message in ((["--only", "pipeline_hf,nope"], "no step 'nope'"), (["--frobnicate"], "unknown argument"),
                          (["--budget", "10"], "--budget must be >= 60")):
        done = _check("--cpu", *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    helped = _check("--help")
    assert helped.returncode == 0 and "carry     [\".gpu-wheels\"]" in helped.stdout


def test_failed_setup_fails_the_check_and_blocks_the_steps_after_it(tmp_path: Path) -> None:
    """A Python that reports hydra-core missing: --cpu installs nothing, so setup fails, every
    step that needs it is not run (with the reason), and the check exits 1 with its summary."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    'if [ "$1 $2 $3" = "-m tests.gpu.check deps" ]; then echo hydra-core; exit 0; fi\n'
                    f'exec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    done = _check("--cpu", "--only", "resume_hf,bench", "--out", str(out), "--work", str(tmp_path / "work"),
                  env={"PYTHON": str(fake)})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    steps = {s["name"]: (s["status"], s["reason"]) for s in json.loads((out / "check.json").read_text())["steps"]}
    assert steps["setup"] == ("FAIL", "exit code 1: missing: hydra-core (--cpu installs nothing; make venv does)")
    assert steps["versions"][0] == "PASS"
    assert steps["pipeline_hf"] == steps["bench"] == ("NOT RUN", "setup failed")
    assert steps["resume_hf"] == ("NOT RUN", "needs pipeline_hf (NOT RUN)")
    assert steps["gpu_tests"] == ("NOT RUN", "not selected (--only resume_hf,bench)")
    assert "result: 1 passed, 1 failed (setup), 7 not run; exit code 1" in (out / "summary.txt").read_text()
