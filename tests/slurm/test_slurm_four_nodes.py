"""A job over four nodes of the dev cluster (``slurm/dev-cluster.sh start 4``): srun and MPI agree on
every rank's node and local id, the placement keeps tensor-parallel pairs inside a node while the
data-parallel groups cross nodes, and gloo runs over ``cluster.network_interface``.

The cluster is restarted with four nodes for this module and put back to two after it (as root);
without root a four-node cluster must be up already."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, launch
from tests.slurm.test_slurm_runtime import selftest_on_slurm

pytestmark = [pytest.mark.slurm, pytest.mark.full, pytest.mark.timeout(900)]  # 10 ranks on 4 nodes, a loaded machine

SCRIPT = REPO_ROOT / "slurm" / "dev-cluster.sh"
FOUR_NODES = [  # 2 GPUs a node: 8 GPU ranks on 4 nodes, tp pairs inside a node, dp across nodes
    "cluster.gpus_per_node=2", "cluster.network_interface=lo",
    'roles.actor_train.device_mapping="list(range(0,4))"', "roles.actor_train.backend=fsdp:d2t2",
    'roles.reference.device_mapping="list(range(0,4))"',
    'roles.actor_infer.device_mapping="range(4,8)"', "roles.actor_infer.backend=vllm:d2t2",
    "roles.reward.world_size=2",
]


def nodes_up() -> set[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=60)
    return {n for n, t in (ln.split() for ln in out.stdout.splitlines() if len(ln.split()) == 2)
            if t.rstrip("*") in ("idle", "mix", "alloc")}


@pytest.fixture(scope="module")
def four_nodes(cluster: None) -> Iterator[None]:
    if os.geteuid() != 0:
        if not {"n1", "n2", "n3", "n4"} <= nodes_up():
            pytest.fail("this test needs the dev cluster with four nodes: run `sudo bash slurm/dev-cluster.sh start 4` "
                        "(and `... start` afterwards for the two-node one)")
        yield
        return
    start = subprocess.run(["bash", str(SCRIPT), "start", "4"], capture_output=True, text=True, timeout=900)
    assert start.returncode == 0, f"the four-node cluster did not start:\n{start.stdout}\n{start.stderr}"
    try:
        yield
    finally:
        back = subprocess.run(["bash", str(SCRIPT), "start", "2"], capture_output=True, text=True, timeout=900)
        assert back.returncode == 0, f"the two-node cluster did not come back:\n{back.stdout}\n{back.stderr}"


def test_a_job_spans_four_nodes_with_srun_and_mpi_agreeing_on_every_rank(four_nodes: None, run_root: Path) -> None:
    out = selftest_on_slurm(run_root / "run", *FOUR_NODES, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run_root / "run" / "selftest.json").read_text())
    placed = json.loads((run_root / "run" / "placement.json").read_text())
    assert result["ok"], result["problems"]
    assert len(result["reports"]) == placed["world_size"]
    for rank, rep in result["reports"].items():
        slot = placed["processes"][int(rank)]
        assert (rep["slurm_nodeid"], rep["slurm_localid"]) == (slot["node"], slot["local_rank"]), rank
        assert rep["torch_rank"] == int(rank) and rep["roles"] == slot["roles"]
    host_of_node = {rep["slurm_nodeid"]: rep["host"] for rep in result["reports"].values()}
    assert host_of_node == {0: "n1", 1: "n2", 2: "n3", 3: "n4"}  # each node its own slurmd and hostname
    sums = result["sums"]
    # actor_train: GPU ranks 0-3 = (dp 2, tp 2) on nodes 0 and 1; a tp pair inside node 0 sums
    # (0+1) + (1+1) = 3, a dp pair across the nodes (0+1) + (2+1) = 4
    assert sums["0"]["actor_train/tp"] == 3.0 and sums["0"]["actor_train/dp"] == 4.0
    assert sums["4"]["sync"] == 1.0 + 5 + 6 + 7 + 8  # train's first rank on node 0, inference on nodes 2 and 3


def test_a_tensor_parallel_group_across_nodes_is_refused_before_submitting(four_nodes: None, run_root: Path) -> None:
    out = launch(["cluster=slurm", "dry_run=true", f"run_dir={run_root / 'run'}", *FOUR_NODES,
                  "roles.actor_train.backend=fsdp:d1t4"], run_root)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "spans nodes" in out.stderr and "submitted" not in out.stdout
