"""experiment=code on the two-node Slurm test cluster: code_sandbox workers on both nodes run the
responses in their own namespaces (inside each node's own mount and UTS namespace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = [pytest.mark.slurm, pytest.mark.full]


def test_code_sandbox_workers_on_both_nodes(run_root: Path) -> None:
    run = run_root / "run"
    out = launch(["experiment=code", "cluster=slurm", "cluster.cpus_per_task=1", "cluster.gpus_per_node=1", "wait=true",
                  "steps=3", f"run_dir={run}", "roles.code_sandbox.world_size=2", "algo.prompts_per_step=4",
                  "algo.samples_per_prompt=4"], run_root, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["sandbox/tests_run"] == 7 * 4 * 4 for r in rows)
    placed = json.loads((run / "placement.json").read_text())
    workers = [(p["world_rank"], p["node"]) for p in placed["processes"]
               if any(role == "code_sandbox" for role, _ in p["roles"])]
    assert sorted(node for _, node in workers) == [0, 1], workers
    for rank, _ in workers:
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert "code sandbox: isolation namespaces" in log, log[-2000:]
