"""The sbatch script a config produces is kept as a golden file: a change to what we submit
shows up in review. Regenerate with RLBATCH_UPDATE_GOLDEN=1 pytest tests/unit/test_sbatch_golden.py.

Scripts are rendered from ``check(cfg, runnable=False)``: most cases name engines this build does
not have (vllm, megatron), so the launcher refuses them before it renders anything
(tests/unit/test_presets.py asserts that, and that the runnable ones dry-run to these very files).
Their files are kept because the request they show comes from the placement alone: it is what we
will submit once those engines exist, and a change to it still deserves a review."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rlbatch.config.validate import check
from rlbatch.launch.compose import compose
from rlbatch.launch.slurm import sbatch_script

GOLDEN = Path(__file__).parents[1] / "golden" / "sbatch"
CASES = {
    "default": [],
    "roll_disaggregated_24gpu": ["roles=roll_disaggregated_24gpu"],
    "roll_mixed_cpu_sandbox": ["roles=roll_mixed_cpu_sandbox", "cluster.partition=gpu", "cluster.account=proj1"],
    "roll_disaggregated_24gpu_ib0": ["roles=roll_disaggregated_24gpu", "cluster.network_interface=ib0",
                                     "+cluster.env.NCCL_DEBUG=WARN"],
    "areal_16gpu": ["roles=areal_16gpu", "cluster.qos=high", "+cluster.sbatch_args.exclusive=true"],
    "areal_moe_hybrid_32gpu": ["roles=areal_moe_hybrid_32gpu", "cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3",
                               "cluster.container_mounts=/scratch:/scratch", "cluster.mpi=pmix"],
}


def render(overrides: list[str]) -> str:
    cfg = compose(["cluster=slurm", "run_dir=/shared/runs/example", *overrides])
    text = sbatch_script(cfg, check(cfg, runnable=False), Path("/shared/runs/example"))
    return text.replace(sys.executable, "PYTHON")


@pytest.mark.parametrize("name", sorted(CASES))
def test_sbatch_script_matches_golden(name: str) -> None:
    text = render(CASES[name])
    path = GOLDEN / f"{name}.sh"
    if os.environ.get("RLBATCH_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with RLBATCH_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"the sbatch script for {name} changed; review and regenerate the golden file"


def test_request_comes_from_the_placement() -> None:
    text = render(["roles=roll_mixed_cpu_sandbox"])
    # 16 GPU ranks on 2 nodes of 8; 8 sandbox workers + 1 reward + controller spread over them.
    assert "#SBATCH --nodes=2" in text
    assert "#SBATCH --gres=gpu:8" in text
    assert "#SBATCH --ntasks-per-node=13" in text
    assert "--mpi=pmi2 --kill-on-bad-exit=1" in text


def test_cpu_device_jobs_keep_freed_memory_for_reuse() -> None:
    assert "export MALLOC_MMAP_THRESHOLD_=" in render(["cluster.device=cpu"])
    assert "MALLOC_" not in render(["cluster.device=cuda"]) and "MALLOC_" not in render([])
