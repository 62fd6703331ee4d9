"""The env role: ``experiment=multiturn +roles.env.world_size=2`` trains with every episode hosted
by the two env workers (not on the inference ranks' threads), and an env worker killed with
SIGKILL mid-rollout ends the job fast, the report naming its role and rank."""

from __future__ import annotations

import datetime
import json
import re
import time
from pathlib import Path

import pytest

from tests.conftest import launch, rank_logs

pytestmark = pytest.mark.dist
# 8 groups of 32 trajectories a step (256, 128 per env worker): small enough for a loaded 2-core machine.
RUN = ["experiment=multiturn", "+roles.env.world_size=2", "algo.prompts_per_step=8", "cluster.timeout_s=60"]
ENV1 = "rank 4 (env[1]; node 0)"
"""Placement of the default roles plus two env workers: GPU ranks 0-1, the reward worker 2, env[0]
and env[1] 3 and 4, the controller 5 (``dry_run=true`` prints it)."""


@pytest.mark.timeout(400)
def test_env_workers_host_the_episodes_and_one_killed_ends_the_job_naming_it(run_root: Path) -> None:
    """One launch: two steps with every episode on the env workers, then env[1] kills itself
    (SIGKILL) at its 800th step request, in the third step's rollout (each worker takes 128
    episodes of 3 steps a step). The Slurm test (tests/slurm/test_slurm_env_role.py) counts what
    each worker hosted in a run that ends normally."""
    run = run_root / "killed"
    out = launch([*RUN, "steps=3", f"run_dir={run}"], run_root, env={"RLBATCH_FAULT": "kill:4:env_step:800"}, timeout=300)
    ended = time.time()
    assert out.returncode != 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1], rows
    for row in rows:
        assert (row["env/hosted_frac"], row["env/hosts"]) == (1.0, 2.0), row
        assert (row["env/turns_mean"], row["env/end/done"]) == (3.0, 1.0), row
        assert (row["tokens/generated"], row["tokens/observed"]) == (3 * row["samples"], 6 * row["samples"]), row
        assert row["env/reward_mean"] == pytest.approx(row["reward_mean"], abs=1e-6), row
    report = out.stderr[out.stderr.find("the run failed"):]
    assert f"{ENV1} died first" in report, out.stderr[-3000:]
    fault = re.search(r"^(\S+ \S+) \[rank 4 \(env\[1\]; node 0\)\] WARNING rlbatch\.runtime\.faults: "
                      r"injecting fault 'kill:4:env_step:800' at env_step", rank_logs(run), re.M)
    assert fault is not None
    killed_at = datetime.datetime.strptime(fault.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    # the launcher ends the job as soon as the process is gone: not the control timeout (60 s), nor
    # the client's wait for a reply (env.step_timeout_s + 60 s)
    assert ended - killed_at < 20, f"the job ended {ended - killed_at:.0f}s after the worker was killed"
