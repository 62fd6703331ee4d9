"""``tools/gpu_check.sh --cpu``: the GPU check's steps on the CPU, so the check that a lent GPU
machine runs does not rot in between. Every step a CPU can run passes (the one-GPU pipeline's
launches with hf, its resume, the vLLM pipeline's config, the benchmark's smoke mode), the GPU-only
ones say why they did not run, and the files a lent machine sends back are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.dist, pytest.mark.full]
SCRIPT = REPO_ROOT / "tools" / "gpu_check.sh"


def test_gpu_check_cpu_mode_passes_every_step_a_cpu_can_run(run_root: Path) -> None:
    out, work = run_root / "out", run_root / "work"
    done = subprocess.run(["bash", str(SCRIPT), "--cpu", "--out", str(out), "--work", str(work)], capture_output=True,
                          text=True, timeout=420, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    check = json.loads((out / "check.json").read_text())
    status = {s["name"]: s["status"] for s in check["steps"]}
    assert status == {"setup": "PASS", "versions": "PASS", "pipeline_hf": "PASS", "resume_hf": "PASS",
                      "vllm_config": "PASS", "pipeline_vllm": "NOT RUN", "resume_vllm": "NOT RUN", "bench": "PASS",
                      "gpu_tests": "NOT RUN"}, done.stdout[-4000:]
    reason = {s["name"]: s["reason"] for s in check["steps"]}
    assert "need CUDA" in reason["pipeline_vllm"] and reason["resume_vllm"] == "needs pipeline_vllm (NOT RUN)"
    # tests/gpu collects and skips without CUDA; the hf pipeline test is pipeline_hf's own launch,
    # not run twice (the vLLM one is collected: its step did not run).
    gpu_tests = reason["gpu_tests"]
    assert gpu_tests.startswith("all 5 collected tests skipped (") and "needs CUDA" in gpu_tests, gpu_tests
    assert gpu_tests.endswith("; 1 deselected (the pipeline steps above ran their launches)"), gpu_tests
    figures = check["figures"]
    assert [s["step"] for s in figures["pipeline_hf"]["steps"]] == [0, 1]
    assert [s["step"] for s in figures["resume_hf"]["steps"]] == [2]
    assert all(s["offload/bytes"] > 0 for s in figures["pipeline_hf"]["steps"] + figures["resume_hf"]["steps"])
    assert figures["bench"]["train"]["mfu"] > 0 and figures["bench"]["offload"]["bytes"] > 0
    import torch

    assert check["versions"]["torch"] == torch.__version__ and check["versions"]["cuda_available"] is False
    assert check["versions"]["mpi_library"].startswith("MPICH"), check["versions"]["mpi_library"]
    # What the device tool brings back: at most 8 files, none in a folder.
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "check.json", "logs.tar.gz", "summary.txt"]
    summary = (out / "summary.txt").read_text()
    assert "result: 6 passed, 0 failed (none), 3 not run; exit code 0" in summary, summary
    assert summary in done.stdout
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/pipeline_hf.log", "runs/pipeline_hf/logs/rank0.log", "runs/pipeline_hf/metrics.jsonl"} <= names
    assert not any("checkpoints" in n for n in names)
