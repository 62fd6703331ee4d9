"""The deepspeed engine on real DeepSpeed (gloo, mpiexec): ZeRO-1/2/3 on a role that excludes global
rank 0, exact resume, checkpoints shared with the fsdp engine, and the default experiment learning."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, launch

pytestmark = pytest.mark.dist
SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT_S = 580
"""For a script that hangs. One stage of deepspeed_engine.py builds 6 engines and trains 19 updates of
the tiny model: ~40 s of CPU per rank, plus DeepSpeed's first import (~10 s, 30 s under heavy load)."""


def mpirun(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    port = str(random.Random(str(args)).randrange(30000, 40000) + os.getpid() % 1000)
    try:
        return subprocess.run([str(mpiexec), "-n", str(n), sys.executable, str(SCRIPTS / "deepspeed_engine.py"), port,
                               *args], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        pytest.fail(f"deepspeed_engine.py did not finish in {TIMEOUT_S} s:\n{out[-2000:]}{err[-3000:]}")


@pytest.mark.parametrize("stages", [pytest.param("13", marks=pytest.mark.full), "2"])
def test_zero_stages_on_ranks_without_rank0_match_fsdp_resume_exactly_and_share_checkpoints(
        stages: str, tmp_path: Path) -> None:
    out = mpirun(3, str(tmp_path), stages)
    for stage in stages:
        assert out.stdout.count(f"ZeRO-{stage} ok") == 2, out.stdout[-2000:] + out.stderr[-4000:]
    # Every check passed on both ranks (the lines above are printed after them). MPICH's hydra
    # sometimes reports a rank of a script that ends with os._exit right after MPI_Finalize (DeepSpeed's
    # gloo threads abort a normal interpreter exit: mpi_exit.end_script) as killed by signal 9, after
    # its work (tests/dist/scripts/world_gpu_node.py has the same); any other failure still fails here.
    ended = out.returncode == 0 or (out.returncode == 9 and "Killed (signal 9)" in out.stdout + out.stderr
                                    and "Traceback" not in out.stderr)
    assert ended, out.stdout[-2000:] + out.stderr[-4000:]


def _rewards(run_dir: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Colocated (the first command users try, ZeRO-3): first >= 0.8 at step 34 of the seeded run (0.96 at
# step 39), so 40 steps reach it. Disaggregated (deepspeed:d1 beside hf:d1): 0.0 -> 0.60 by step 24;
# 25 steps show the rise.
@pytest.mark.full
@pytest.mark.parametrize("roles, backend, steps, want", [("colocated", "deepspeed:d2", 40, 0.8),
                                                          ("disaggregated", "deepspeed:d1", 25, 0.3)])
def test_default_experiment_learns_with_deepspeed(roles: str, backend: str, steps: int, want: float,
                                                  run_root: Path) -> None:
    d = run_root / roles
    done = launch([f"run_dir={d}", f"roles={roles}", f"roles.actor_train.backend={backend}", f"steps={steps}"], run_root,
                  timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rewards = _rewards(d)
    assert rewards[0] < 0.3 and max(rewards[-5:]) >= want, rewards
