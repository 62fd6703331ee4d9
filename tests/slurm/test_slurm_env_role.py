"""The env role on the two-node Slurm test cluster: one env worker on each node hosts the episodes
of both inference ranks (one per node), over the job's MPI communicator across the nodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.slurm


def test_env_workers_on_both_nodes_host_the_episodes(run_root: Path) -> None:
    run = run_root / "run"
    out = launch(["experiment=multiturn", "cluster=slurm", "cluster.cpus_per_task=1", "cluster.gpus_per_node=1",
                  "wait=true", "steps=2", f"run_dir={run}", "+roles.env.world_size=2", "algo.prompts_per_step=4"],
                 run_root, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all((r["env/hosted_frac"], r["env/hosts"], r["env/end/done"]) == (1.0, 2.0, 1.0) for r in rows), rows
    placed = json.loads((run / "placement.json").read_text())
    workers = [(p["world_rank"], p["node"]) for p in placed["processes"] if any(role == "env" for role, _ in p["roles"])]
    assert sorted(node for _, node in workers) == [0, 1], workers
    hosts = {json.loads((run / "logs" / f"rank{rank}.status").read_text())["host"] for rank, _ in workers}
    assert len(hosts) == 2, hosts  # n1 and n2: two slurmd "nodes"
    for rank, _ in workers:  # 2 steps x 4 groups x 32 trajectories, half on each worker, 3 steps each
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert re.search(r"env\[\d\] worker hosted 128 episodes, 384 steps \(0 requests failed\)", log), log[-2000:]
