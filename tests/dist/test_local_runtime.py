"""The runtime on real processes started by the local launcher (mpiexec + gloo)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import launch

pytestmark = pytest.mark.dist

TWO_NODES = [  # 2 logical nodes x 4 GPU ranks: colocated and disaggregated roles, 2 CPU workers
    "cluster.gpus_per_node=4",
    'roles.actor_train.device_mapping="list(range(0,4))"', "roles.actor_train.backend=fsdp:d2t2",
    'roles.reference.device_mapping="list(range(0,4))"',
    'roles.actor_infer.device_mapping="range(4,8)"', "roles.actor_infer.backend=vllm:d2t2",
    "roles.reward.world_size=2",
]


def selftest(run_dir: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 240):
    return launch(["program=selftest", f"run_dir={run_dir}", *extra], run_dir.parent, env=env, timeout=timeout)


@pytest.mark.parametrize("placement", [[], ["roles=disaggregated"], pytest.param(TWO_NODES, marks=pytest.mark.full)],
                         ids=["colocated", "disaggregated", "two_nodes"])
def test_every_rank_is_where_the_placement_says(run_root: Path, placement: list[str]) -> None:
    out = selftest(run_root / "run", *placement)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "selftest ok" in out.stdout
    result = json.loads((run_root / "run" / "selftest.json").read_text())
    placed = json.loads((run_root / "run" / "placement.json").read_text())
    assert result["ok"] and not result["problems"]
    assert len(result["reports"]) == placed["world_size"]
    for rank, rep in result["reports"].items():
        slot = placed["processes"][int(rank)]
        assert (rep["node"], rep["gpu_rank"], rep["local_gpu"], rep["roles"]) == (
            slot["node"], slot["gpu_rank"], slot["local_gpu"], slot["roles"])
        assert rep["torch_rank"] == int(rank)


@pytest.mark.full
def test_collective_sums_in_role_groups_mesh_axes_and_sync_group(run_root: Path) -> None:
    out = selftest(run_root / "run", *TWO_NODES)
    assert out.returncode == 0, out.stderr[-3000:]
    sums = json.loads((run_root / "run" / "selftest.json").read_text())["sums"]
    # actor_train is ranks 0-3 as (dp=2, tp=2): the sum of (rank + 1) over the role is 10,
    # a tp pair {0,1} sums to 3, a dp pair {0,2} sums to 4; sync = train's first rank + infer 4..7.
    assert sums["0"]["actor_train"] == 10.0
    assert sums["0"]["actor_train/tp"] == 3.0
    assert sums["0"]["actor_train/dp"] == 4.0
    assert sums["5"]["actor_infer/tp"] == 5.0 + 6.0  # infer is (dp=2, pp=1, tp=2) over 4..7
    assert sums["4"]["sync"] == 1.0 + 5 + 6 + 7 + 8
    assert sums["8"]["reward"] == 9.0 + 10.0


@pytest.mark.parametrize(("fault", "rank", "role"), [("kill", 1, "actor_train[1]"), ("raise", 2, "reward[0]"),
                                                      pytest.param("hang", 0, "actor_train[0]", marks=pytest.mark.full)])
def test_a_failing_rank_ends_the_job_fast_and_is_named(run_root: Path, fault: str, rank: int, role: str) -> None:
    start = time.monotonic()
    out = selftest(run_root / "run", "cluster.timeout_s=10", env={"RLBATCH_FAULT": f"{fault}:{rank}"}, timeout=120)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end after a {fault}"
    report = out.stderr[out.stderr.find("the run failed"):]
    assert f"rank {rank} ({role}" in report, report


@pytest.mark.full
def test_two_jobs_on_one_node_both_start(run_root: Path) -> None:
    results: dict[str, object] = {}

    def run(name: str) -> None:
        results[name] = selftest(run_root / name)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("a", "b"):
        out = results[name]
        assert out.returncode == 0, out.stderr[-3000:]  # type: ignore[attr-defined]
