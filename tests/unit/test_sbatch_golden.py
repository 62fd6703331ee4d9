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
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.launch.slurm import rank_env, sbatch_script

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
    # Every field that reaches the script set to an unusual but legal value: quotes, spaces, '$',
    # '#', lists, a multi-line setup block (tests/unit/test_sbatch_injection.py: the hostile ones).
    "unusual_but_legal": [
        "run_dir=\"/shared/runs/it's my run\"", "cluster.partition='gpu,gpu-long'", "cluster.account=proj.ml-1",
        "cluster.qos=high_prio", "cluster.constraint='[a100|h100]&ib'", "cluster.job_name='grpo run #3 $HOME'",
        "cluster.mem_gb=64", "cluster.time_min=90", "cluster.mpi=pmix", "cluster.network_interface=ib0",
        "cluster.container_image='/shared/images/my image.sqsh'",
        "cluster.container_mounts='/data/my data:/data,/scratch:/scratch'",
        "cluster.srun_args=['--cpu-bind=none','--export=ALL']", "cluster.preempt_signal=TERM",
        "cluster.signal_delay_s=300", "+cluster.sbatch_args.exclusive=true", "+cluster.sbatch_args.mail_type='END,FAIL'",
        "+cluster.sbatch_args.comment=\"it's $USER's run\"", "+cluster.env.WANDB_NOTES='it\\'s \"$HOME\" `x` $(id)'",
        "cluster.setup=['module load cuda/12.4','source \"/shared/venvs/my env/bin/activate\"',"
        "'if [ -n \"$SLURM_JOB_ID\" ]; then\n  echo \"job $SLURM_JOB_ID\"\nfi']",
    ],
}


def render(overrides: list[str]) -> str:
    cfg = compose(["cluster=slurm", "run_dir=/shared/runs/example", *overrides])
    return render_config(cfg)


def render_config(cfg: Any) -> str:
    text = sbatch_script(cfg, check(cfg, runnable=False), Path(str(cfg.run_dir)))
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


HEADER_OPTIONS = {"cpus-per-task", "gres", "job-name", "nodes", "ntasks-per-node", "open-mode", "output", "requeue",
                  "signal", "time", "wckey", "partition", "account", "qos", "constraint", "mem"}
"""The #SBATCH options rlbatch and submitit write; any other comes from cluster.sbatch_args."""


def structure_problems(text: str, cfg: Any) -> list[str]:
    """Where the script differs from its intended shape: one #SBATCH line per known option, and
    exactly the setup lines, one export per rank variable, the run directory's lock, srun and the
    post-mortem as commands.
    A value that escaped its line shows up here as an extra or a changed line."""
    known = HEADER_OPTIONS | {str(k).replace("_", "-") for k in cfg.cluster.sbatch_args}
    options = [ln.removeprefix("#SBATCH --").split("=", 1)[0] for ln in text.split("\n") if ln.startswith("#SBATCH")]
    problems = [f"unknown option --{o}" for o in options if o not in known]
    problems += [f"--{o} appears {options.count(o)} times" for o in set(options) if options.count(o) > 1]
    commands = [ln for ln in text.split("\n") if ln.strip() and not ln.lstrip().startswith("#")]
    setup = [ln for entry in cfg.cluster.setup for ln in str(entry).split("\n")]
    expected = [*setup, *(f"export {k}=" for k in rank_env(cfg, Path(str(cfg.run_dir)))),
                "exec {RLBATCH_LOCK_FD}<>", "PYTHON -m rlbatch.launch.joblock ",  # the job's lock on the run_dir
                "export SUBMITIT_EXECUTOR=slurm", "srun --unbuffered --output ", "PYTHON -m rlbatch.runtime.postmortem "]
    if len(commands) != len(expected) or not all(c.startswith(e) for c, e in zip(commands, expected, strict=False)):
        problems.append(f"commands {commands} are not the expected {expected}")
    return problems


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_line_of_the_script_is_one_rlbatch_meant_to_write(name: str) -> None:
    cfg = compose(["cluster=slurm", "run_dir=/shared/runs/example", *CASES[name]])
    assert structure_problems(render_config(cfg), cfg) == []


def test_the_shape_check_sees_a_value_that_escaped_its_line() -> None:
    cfg = compose(["cluster=slurm", *CASES["unusual_but_legal"]])
    text = render_config(cfg)
    directive = text.replace("--partition=gpu,gpu-long", "--partition=gpu\n#SBATCH --wrap=x")
    command = text.replace("#SBATCH --job-name='grpo run #3 $HOME'", "#SBATCH --job-name='a\ntouch x #'")
    assert structure_problems(directive, cfg) == ["unknown option --wrap"]
    assert len(structure_problems(command, cfg)) == 1

