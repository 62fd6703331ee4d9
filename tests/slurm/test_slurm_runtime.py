"""The runtime on the real two-node Slurm test cluster (slurm/dev-cluster.sh; `make test` starts it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbatch.runtime.env import MPI_ENV
from tests.conftest import REPO_ROOT, launch, rank_logs
from tests.dist.test_learning import LEARNERS, best_mean, rewards
from tests.dist.test_local_runtime import TWO_NODES

pytestmark = pytest.mark.slurm


def wait_gone(job_ids: list[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i"], capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(1)
    raise AssertionError(f"jobs {job_ids} still queued after {timeout}s")


def preempt_at_step_2_and_wait(run: Path, job: str, steps: int, start_s: float = 180, finish_s: float = 300) -> None:
    """Once the job has logged 2 steps, send it SIGUSR2 (what Slurm sends before preemption or the
    time limit); wait for the requeued job to write its last checkpoint (step ``steps - 1``) and leave."""
    deadline = time.monotonic() + start_s
    while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, "the job did not reach step 2"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    deadline = time.monotonic() + finish_s
    while not (run / "checkpoints" / f"step_{steps - 1:06d}" / "manifest.json").exists():
        assert time.monotonic() < deadline, "the requeued job did not finish"
        time.sleep(1)
    wait_gone([job])


def selftest_on_slurm(run_dir: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return launch(["program=selftest", "cluster=slurm", "cluster.cpus_per_task=1", "wait=true", f"run_dir={run_dir}", *extra],
                  run_dir.parent, timeout=timeout)


def test_mpi_starts_under_srun_after_a_heavy_import(run_root: Path) -> None:
    """MPI_Init under srun --mpi=pmi2 in ranks that imported vLLM first (a process whose memory
    holds more than a bare interpreter's), on two nodes. MPICH 5.0.1 and 5.0.2 publish each
    rank's UCX address through PMI in segments padded with whatever the rank's memory held; the
    Slurm PMI server rejects their lines ("mpi/pmi2: value not properly terminated"), and
    MPI_Init aborted or hung, 3 tries of 3 on the test cluster. MPICH 4.3 (pyproject pins < 5):
    3 of 3 clean, ~10 s."""
    code = ("import vllm\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
            "print('rank', c.Get_rank(), 'world', c.allreduce(1), flush=True)")
    done = subprocess.run(["srun", "-N2", "-n4", "--mpi=pmi2", "--kill-on-bad-exit=1", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, cwd=run_root, env=dict(os.environ) | MPI_ENV)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "mpi/pmi2" not in output, output[-3000:]
    assert sorted(done.stdout.split("\n")[:4]) == [f"rank {r} world 4" for r in range(4)], output[-3000:]


def test_two_nodes_identity_groups_and_sums(run_root: Path) -> None:
    out = selftest_on_slurm(run_root / "run", *TWO_NODES)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"submitted Slurm job \d+", out.stdout)
    result = json.loads((run_root / "run" / "selftest.json").read_text())
    placed = json.loads((run_root / "run" / "placement.json").read_text())
    assert result["ok"], result["problems"]
    hosts = {int(r): rep["host"] for r, rep in result["reports"].items()}
    for rank, rep in result["reports"].items():
        slot = placed["processes"][int(rank)]
        assert (rep["slurm_nodeid"], rep["slurm_localid"]) == (slot["node"], slot["local_rank"])
        assert rep["roles"] == slot["roles"] and rep["local_gpu"] == slot["local_gpu"]
    assert {hosts[r] for r in range(4)} == {"n1"} and {hosts[r] for r in range(4, 8)} == {"n2"}
    assert {hosts[8], hosts[9]} == {"n1", "n2"}, "the two CPU reward workers are spread across nodes"
    assert result["sums"]["0"]["actor_train/tp"] == 3.0 and result["sums"]["4"]["sync"] == 27.0


@pytest.mark.full
def test_sweep_submits_one_job_per_point(run_root: Path) -> None:
    out = launch(["-m", "program=selftest", "cluster=slurm", "cluster.cpus_per_task=1", f"run_dir={run_root}/sweep",
                  "seed=1,2,3"], run_root, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    jobs = re.findall(r"submitted Slurm job (\d+)", out.stdout)
    assert len(set(jobs)) == 3, out.stdout
    wait_gone(jobs)
    for k in range(3):
        run = run_root / "sweep" / str(k)
        assert json.loads((run / "selftest.json").read_text())["ok"]
    seeds = sorted(int(re.search(r"^seed: (\d+)$", (run_root / "sweep" / str(k) / "config.yaml").read_text(), re.M).group(1)) for k in range(3))
    assert seeds == [1, 2, 3]


@pytest.mark.full
def test_kill_9_ends_the_job_fast_and_names_the_rank(run_root: Path) -> None:
    start = time.monotonic()
    out = selftest_on_slurm(run_root / "run", *TWO_NODES, "cluster.timeout_s=20", "+cluster.env.RLBATCH_FAULT=kill:5")
    assert out.returncode != 0
    culprits = [ln for ln in (out.stderr + out.stdout).splitlines() if ln.startswith("  rank ")]
    assert any(ln.startswith("  rank 5 (actor_infer[0]") for ln in culprits), out.stderr[-3000:]
    states = {r: json.loads((run_root / "run" / "logs" / f"rank{r}.status").read_text())["state"] for r in range(11)}
    assert states[5] == "running", states  # the killed rank never wrote another word
    assert time.monotonic() - start < 120  # submission, scheduling and start included
    ended = max(json.loads((run_root / "run" / "logs" / f"rank{r}.status").read_text())["time"] for r in range(11))
    killed_at = json.loads((run_root / "run" / "logs" / "rank5.status").read_text())["time"]
    assert ended - killed_at < 30, "every rank stopped within 30 s of the kill"


@pytest.mark.full
def test_two_jobs_on_one_node_both_start(run_root: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-m", "rlbatch.launch", "program=selftest", "cluster=slurm", "cluster.cpus_per_task=1",
                               "wait=true", f"run_dir={run_root}/{n}", "+cluster.sbatch_args.nodelist=n1"],
                              cwd=run_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in ("a", "b")]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ports = set()
    for n in ("a", "b"):
        log = (run_root / n / "logs" / "rank0.log").read_text()
        ports.add(re.search(r"init_process_group\(gloo\) at n1:(\d+)", log).group(1))
        assert json.loads((run_root / n / "selftest.json").read_text())["reports"]["0"]["host"] == "n1"
    assert len(ports) == 2


def test_plain_sbatch_template(run_root: Path) -> None:
    run = run_root / "plain"
    sub = subprocess.run(["sbatch", "--parsable", f"--chdir={run_root}", f"--export=ALL,PYTHON={sys.executable},RUN_DIR={run}",
                          str(REPO_ROOT / "slurm" / "rlbatch.sbatch"), "program=selftest"], capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    wait_gone([job])
    output = (run_root / f"rlbatch-{job}.out").read_text()
    assert "selftest ok" in output, output[-3000:]


ON_SLURM = {"colocated": ["roles=colocated"], "disaggregated": ["roles=disaggregated"]}
"""case -> its overrides (hf generating; vLLM's cases: test_vllm_experiment_learns_on_slurm)."""


@pytest.mark.full
@pytest.mark.parametrize("case", list(ON_SLURM))
def test_default_experiment_on_slurm(run_root: Path, case: str) -> None:
    extra = ON_SLURM[case]
    run = run_root / "run"
    out = launch(["cluster=slurm", "cluster.cpus_per_task=1", "wait=true", "steps=3", f"run_dir={run}", *extra,
                  "algo.prompts_per_step=8", "algo.samples_per_prompt=4"], run_root, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert (run / "reward_curve.png").exists()
    logs = rank_logs(run)
    assert "vLLM actor_infer engine started" not in logs, logs[-3000:]


VLLM_ENGINES = {"vllm-colocated": 2, "vllm-disaggregated": 1}
"""The vLLM learners of tests/dist/test_learning.py -> how many engines each starts: one on each
of the two training ranks, or one on a rank of its own."""


@pytest.mark.full
@pytest.mark.parametrize("learner", list(VLLM_ENGINES))
def test_vllm_experiment_runs_on_slurm(run_root: Path, learner: str) -> None:
    """The local vLLM learners' runs, submitted to the cluster and run under srun: their first 4
    steps, each with a weight sync into the engines (the local tests follow the same seeded runs
    from chance to >= 0.8)."""
    args, timeout, _ = LEARNERS[learner]
    run = run_root / "run"
    out = launch(["cluster=slurm", "cluster.cpus_per_task=1", "wait=true", f"run_dir={run}",
                  *[a for a in args if not a.startswith("steps=")], "steps=4"], run_root, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(r["sync/bytes"] > 0 for r in rows), rows
    logs = rank_logs(run)
    assert logs.count("vLLM actor_infer engine started") == VLLM_ENGINES[learner], logs[-3000:]


ROLL_8GPU = ["cluster.gpus_per_node=4", "model.num_heads=2", "model.num_kv_heads=1"]
"""ROLL's 8-GPU vLLM examples on the test cluster as 2 nodes of 4 GPUs."""


@pytest.mark.full
def test_roll_disaggregated_preset_trains_with_vllm_on_two_nodes(run_root: Path) -> None:
    """roles=roll_disaggregated_8gpu: fsdp:d4 on n1, four vLLM engines on n2, weights synced across
    the nodes every step (~85 s)."""
    run = run_root / "run"
    out = launch(["cluster=slurm", "cluster.cpus_per_task=1", "wait=true", "steps=2", f"run_dir={run}",
                  "roles=roll_disaggregated_8gpu", *ROLL_8GPU, "algo.prompts_per_step=8", "algo.samples_per_prompt=4"],
                 run_root, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    started = [ln for ln in rank_logs(run).splitlines() if "vLLM actor_infer engine started" in ln]
    assert {node: sum(f"node {node})]" in ln for ln in started) for node in (0, 1)} == {0: 0, 1: 4}, started


@pytest.mark.full
def test_roll_colocated_preset_places_an_engine_beside_each_trainer_on_two_nodes(run_root: Path) -> None:
    """roles=roll_colocated_8gpu: fsdp:d8 and vllm:d8 on the same eight ranks, four on each node,
    checked by program=selftest on real processes (identity, role groups, weight sync); starting its
    eight engines is the disaggregated preset's path four times over on one more node (~80 s)."""
    out = selftest_on_slurm(run_root / "run", "roles=roll_colocated_8gpu", *ROLL_8GPU)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run_root / "run" / "selftest.json").read_text())
    assert result["ok"], result["problems"]
    infer = [rep for rep in result["reports"].values() if any(r[0] == "actor_infer" for r in rep["roles"])]
    assert all(any(r[0] == "actor_train" for r in rep["roles"]) for rep in infer), infer
    assert sorted(rep["host"] for rep in infer) == ["n1"] * 4 + ["n2"] * 4, infer


ACROSS_NODES = ["cluster.gpus_per_node=2", "roles=disaggregated", "roles.actor_train.device_mapping=[1,2]",
                "roles.reference.device_mapping=[1,2]", "roles.actor_infer.device_mapping=[0]"]
"""actor_train and the reference on GPU ranks 1 (node 0) and 2 (node 1), the hf actor_infer on rank 0:
the training role spans both nodes and does not hold global rank 0."""

TRAIN_ENGINES = {
    # Megatron's two pipeline stages on different nodes (activations and gradients cross them).
    "megatron-p2": ["roles.actor_train.backend=megatron:p2", "plugins=[tests.plugins.megatron_cpu]"],
    # ZeRO-3 on a role without global rank 0, its parameter gathers across the nodes.
    "deepspeed-zero3": ["roles.actor_train.backend=deepspeed:d2", "+roles.actor_train.engine_args.zero_stage=3"],
}


@pytest.mark.full
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("engine", list(TRAIN_ENGINES))
def test_training_engine_across_two_nodes_learns(run_root: Path, engine: str) -> None:
    """The default experiment's first 25 steps with the training role split over both nodes: from
    chance to a 3-step mean reward >= 0.35 (seeded: 0.54 megatron p2, 0.53 deepspeed ZeRO-3; both
    pass 0.8 by step 40 of the 80-step run)."""
    run = run_root / "run"
    out = launch(["cluster=slurm", "cluster.cpus_per_task=1", "wait=true", f"run_dir={run}", "steps=25", *ACROSS_NODES,
                  *TRAIN_ENGINES[engine]], run_root, timeout=1100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = rewards(run)
    assert r[0] <= 0.05 and best_mean(r) >= 0.35, r
    built = [ln for ln in rank_logs(run).splitlines() if "built " in ln and "engine for actor_train" in ln]
    assert {node: sum(f"node {node})]" in ln for ln in built) for node in (0, 1)} == {0: 1, 1: 1}, built


PREEMPTED = {
    # Enough steps that the job is still running when the signal arrives (a step takes ~0.1 s).
    "sync": ([], 60),
    # Asynchronous: the next step's generation is in flight when the signal comes; the checkpoint
    # holds it, and the requeued job trains on it rather than generating it again (~0.4 s a step).
    "async": (["roles=disaggregated", "algo.max_staleness=1", "algo.off_policy=tis"], 15),
}


@pytest.mark.parametrize("case", [c if c == "sync" else pytest.param(c, marks=pytest.mark.full) for c in PREEMPTED])
def test_preempted_job_requeues_resumes_and_matches_an_uninterrupted_run(run_root: Path, case: str) -> None:
    extra, steps = PREEMPTED[case]
    args = ["algo.prompts_per_step=8", "algo.samples_per_prompt=4", "data.reward_fn=rlbatch.rewards.rules:format_reward",
            f"steps={steps}", *extra]
    run = run_root / "preempted"
    sub = launch(["cluster=slurm", "cluster.cpus_per_task=1", f"run_dir={run}", *args], run_root)
    assert sub.returncode == 0, sub.stderr[-3000:]
    job = re.search(r"submitted Slurm job (\d+)", sub.stdout).group(1)
    preempt_at_step_2_and_wait(run, job, steps)
    restarts = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    logs = "".join(p.read_text() for p in (run / "slurm").glob("*_log.out"))
    assert "signal SIGUSR2; checkpoint saved" in logs and "requeued" in logs and "resuming from" in logs
    # what `tail -f` of the job log (named at submission) shows: one line per step, the controller's
    assert "tail -f" in sub.stdout and re.search(rf"rlbatch\.loop\.metrics: step {steps}/{steps}; reward ", logs), logs[-3000:]
    assert "Restarts=1" in restarts or not restarts  # the record may already be purged (MinJobAge)
    whole = run_root / "whole"
    assert launch([f"run_dir={whole}", *args], run_root).returncode == 0
    ex = [subprocess.run([sys.executable, "-m", "rlbatch.export", str(d), str(run_root / f"e{k}")], capture_output=True)
          for k, d in enumerate((run, whole))]
    assert all(e.returncode == 0 for e in ex)
    assert (run_root / "e0" / "model.safetensors").read_bytes() == (run_root / "e1" / "model.safetensors").read_bytes()
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (run, whole)]
    assert [r["step"] for r in rows[0]] == list(range(steps)), "no step lost, none repeated"
    keys = ("reward_mean", "tokens/generated", "train/grad_norm", "train/staleness")
    assert [[r.get(k) for k in keys] for r in rows[0]] == [[r.get(k) for k in keys] for r in rows[1]]
