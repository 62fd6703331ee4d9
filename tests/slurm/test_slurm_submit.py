"""Around a Slurm submission, on the real two-node test cluster (slurm/dev-cluster.sh): what sbatch
refuses, a run directory some node cannot see, and the presets' placements on real processes.

The dev cluster gives each node a private /tmp, which makes a node without the run directory easy
to arrange: the launcher refuses such a run_dir before submitting, so these tests go around it
(the Python API with ``check(cfg, runnable=False)``, or a hand-written sbatch file) to check what
the job reports if it happens anyway.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import launch
from tests.slurm.test_slurm_runtime import selftest_on_slurm, wait_gone

pytestmark = pytest.mark.slurm


def test_a_partition_sbatch_refuses_is_one_line_and_exit_2(run_root: Path) -> None:
    run = run_root / "run"
    out = launch(["program=selftest", "cluster=slurm", "cluster.partition=nope", f"run_dir={run}"], run_root, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.splitlines() == [
        "rlbatch: sbatch refused the job: invalid partition specified: nope; "
        "Batch job submission failed: Invalid partition name specified; nothing was submitted"]
    assert "submitted Slurm job" not in out.stdout
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "logs", "placement.json", "rlbatch.lock"]  # no submitit debris


def test_a_run_directory_missing_on_the_first_node_is_named_by_the_submitter(run_root: Path) -> None:
    run = Path("/tmp") / f"rlbatch-test-{uuid.uuid4().hex[:8]}"  # this machine's /tmp: no node sees it
    code = (
        "from rlbatch.checks.validate import check\n"
        "from rlbatch.config.compose import compose\n"
        "from rlbatch.launch.slurm import submit\n"
        f"cfg = compose(['program=selftest', 'cluster=slurm', 'cluster.cpus_per_task=1', 'wait=true', 'run_dir={run}'])\n"
        "raise SystemExit(submit(cfg, check(cfg, runnable=False)))  # the launcher itself refuses /tmp\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=run_root, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(rf"run directory {run} missing on node n[12]: Slurm could not write the job log there", out.stderr), out.stderr
    assert "never started" not in out.stderr and "Traceback" not in out.stderr


SCRIPT = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=1
#SBATCH --time=5
set -u
# Prepare the run directory on the shared filesystem, then use a copy that only this (the first)
# node has: the ranks on the second node start without it.
SHARED=$("$PYTHON" -m rlbatch.launch.prepare program=selftest cluster=slurm cluster.gpus_per_node=1 \\
         cluster.cpus_per_task=1 "run_dir=$SHARED_RUN")
cp -r "$SHARED" "$LOCAL_RUN"
export MPIR_CVAR_NOLOCAL=1
srun --mpi=pmi2 --kill-on-bad-exit=1 "$PYTHON" -u -m rlbatch.worker "$LOCAL_RUN"
"$PYTHON" -m rlbatch.runtime.postmortem "$LOCAL_RUN"
rm -rf "$LOCAL_RUN"
"""


def test_ranks_on_a_node_without_the_run_directory_are_named_with_that_node(run_root: Path) -> None:
    script = run_root / "job.sbatch"
    script.write_text(SCRIPT)
    local = f"/tmp/rlbatch-test-{uuid.uuid4().hex[:8]}"
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={run_root}", f"--output={run_root}/job-%j.out",
                          f"--export=ALL,PYTHON={sys.executable},SHARED_RUN={run_root / 'run'},LOCAL_RUN={local}",
                          str(script)], capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    wait_gone([job], timeout=120)
    output = (run_root / f"job-{job}.out").read_text()
    # Each rank on n2 says so itself, and the post-mortem names the node instead of "never started".
    assert f"rlbatch: run directory {local} missing on node n2: this rank cannot start" in output, output[-3000:]
    assert f"rlbatch: run directory {local} missing on node n2: ranks 1-2 (node 1) could not start" in output, output[-3000:]
    assert "never started" not in output


@pytest.mark.full
def test_the_ppo_preset_places_its_ranks_on_two_nodes(run_root: Path) -> None:
    """The 8-GPU presets fit the test cluster as 2 nodes of 4 GPUs. The launcher accepts this one
    (tensor-parallel fsdp, fsdp:d4t2, is built); program=selftest starts no engine and checks
    its placement on real processes (identity, every role group, every mesh axis, weight sync).
    ppo_critic_8gpu is the one run here (~90 s): four GPU roles with tp=2 meshes colocated across
    both nodes, two reward workers. ROLL's disaggregated 8-GPU preset trains for real on the cluster
    (test_slurm_runtime.py::test_roll_disaggregated_preset_trains_with_vllm_on_two_nodes)."""
    preset = ["roles=ppo_critic_8gpu", "algo=ppo"]
    accepted = launch(["dry_run=true", "cluster=slurm", f"run_dir={run_root / 'run'}", *preset], run_root, timeout=120)
    assert accepted.returncode == 0 and "rlbatch placement" in accepted.stdout, accepted.stderr[-3000:]
    out = selftest_on_slurm(run_root / "run", "cluster.gpus_per_node=4", *preset)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run_root / "run" / "selftest.json").read_text())
    assert result["ok"], result["problems"]
    hosts = {int(r): rep["host"] for r, rep in result["reports"].items()}
    assert {hosts[r] for r in range(4)} == {"n1"} and {hosts[r] for r in range(4, 8)} == {"n2"}
    assert [r[0] for r in result["reports"]["0"]["roles"]] == ["actor_train", "actor_infer", "reference", "critic"]


@pytest.mark.full
def test_the_areal_flagship_placement_selftests_on_two_8_gpu_nodes(run_root: Path) -> None:
    """AReaL's full example, roles=areal_16gpu (sglang:d2t4 on node 0, fsdp:d4t2 on node 1), as the
    seed documents give it, on the test cluster's two 8-GPU nodes (~40 s): 18 real processes, every
    role group and mesh axis checked by program=selftest (which starts no engine)."""
    out = selftest_on_slurm(run_root / "run", "roles=areal_16gpu")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run_root / "run" / "selftest.json").read_text())
    assert result["ok"], result["problems"]
    reports = {int(r): rep for r, rep in result["reports"].items()}
    assert len(reports) == 18  # 16 GPU ranks, the reward worker, the controller
    assert all(reports[r]["host"] == "n1" and reports[r]["local_gpu"] == r for r in range(8))
    assert all(reports[r]["host"] == "n2" and reports[r]["local_gpu"] == r - 8 for r in range(8, 16))
    assert result["groups"]["actor_infer"] == list(range(8)) and result["groups"]["actor_train"] == list(range(8, 16))
    # the two SGLang workers' tensor-parallel groups are ranks 0-3 and 4-7 (each rank sums its
    # group's ranks + 1), each on consecutive GPUs of node 0, as their engines' schedulers take them
    assert [result["sums"][str(r)]["actor_infer/tp"] for r in range(8)] == [10.0] * 4 + [26.0] * 4
