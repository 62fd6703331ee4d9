"""Multi-turn jobs on the two-node Slurm test cluster: one env worker on each node hosts the
episodes of both inference ranks (one per node), over the job's MPI communicator across the
nodes; a job preempted while trajectories are being played requeues and trains on them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import launch
from tests.dist.test_resume import assert_trained_on_the_saved_episodes, rows, saved_episodes
from tests.slurm.test_slurm_runtime import preempt_at_step_2_and_wait

pytestmark = [pytest.mark.slurm, pytest.mark.full]


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


def test_a_job_preempted_mid_rollout_requeues_and_trains_the_trajectories_it_saved(run_root: Path) -> None:
    """experiment=multiturn with max_staleness=1: SIGUSR2 (what Slurm sends before preemption)
    arrives while the next step's trajectories are being played; the checkpoint holds them, made
    ahead and not trained; the requeued job trains that step on exactly them and loses and repeats
    no step."""
    steps = 12
    run = run_root / "preempted"
    sub = launch(["experiment=multiturn", "cluster=slurm", "cluster.cpus_per_task=1", f"run_dir={run}", f"steps={steps}",
                  "roles=disaggregated", "algo.max_staleness=1", "algo.off_policy=tis", "algo.prompts_per_step=4",
                  "algo.samples_per_prompt=4"], run_root)
    assert sub.returncode == 0, sub.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", sub.stdout).group(1)
    preempt_at_step_2_and_wait(run, job, steps, start_s=240, finish_s=400)
    final = run / "checkpoints" / f"step_{steps - 1:06d}"
    logs = "".join(p.read_text() for p in (run / "slurm").glob("*_log.out"))
    assert "signal SIGUSR2; checkpoint saved" in logs and "requeued" in logs and "resuming from" in logs
    got = rows(run)
    assert [r["step"] for r in got] == list(range(steps)), "no step lost, none repeated"
    [preempted] = [d for d in sorted((run / "checkpoints").glob("step_*")) if d != final]
    step, episodes = saved_episodes(preempted)
    assert step == int(preempted.name.split("_")[1]) + 1 and len(episodes) == 16
    assert_trained_on_the_saved_episodes(preempted, got)
