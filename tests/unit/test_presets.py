"""Every preset under conf/ and every golden sbatch file either runs in this build or is refused
before anything is submitted, with a message that names what is missing.

The launcher is driven as a user drives it (``rlbatch.launch.__main__.main``, in-process) with
``dry_run=true``: a runnable preset prints its placement and, with cluster=slurm, the exact sbatch
script, and exits 0; a refused one exits 2, prints one line per problem and nothing else. Presets
are discovered, so a new YAML this build cannot run fails here until its refusal is listed in
REFUSED. Every refused preset is still one the planner accepts (``check(cfg, runnable=False)``).

Golden sbatch files (tests/unit/test_sbatch_golden.py renders them without the build check): the
runnable case must dry-run to exactly its file. The others name engines this build does not have;
the launcher must refuse them, naming those engines. Their files are kept, not deleted, because
the script comes from the placement alone and is what we will submit once those engines exist.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.compose import CONF_DIR, compose
from rlbatch.config.schema import ClusterConfig
from rlbatch.launch.__main__ import main
from rlbatch.osinfo import on_cpu
from tests.unit.test_sbatch_golden import CASES, GOLDEN

RUN_DIR = "run_dir=/shared/runs/preset"
"""Never created by a dry run; on a filesystem every node would see, as cluster=slurm requires."""

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and any(p.glob("*.yaml")))
PRESETS = sorted((group, path.stem) for group in GROUPS for path in (CONF_DIR / group).glob("*.yaml"))

CP_HYBRID = ("roles.actor_train.backend: 'megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)': context parallelism c=2 is built "
             "for padded rows of a dense model on one pipeline stage")
"""Megatron's context parallelism runs on one pipeline stage of a dense model; AReaL's example adds both."""


VLLM_T8 = "roles.actor_infer.backend: 'vllm:d4t8' splits attention over t=8 tensor-parallel ranks, but num_heads=4"
"""vLLM cannot split the tiny model's 4 heads over 8 ranks (a preset for a real model.path)."""
CPU_HEAD_DIM = ["roles.actor_infer: vllm on CPU needs head_dim in"] if on_cpu(ClusterConfig(name="local")) else []
"""cluster=local on a machine without a GPU runs vLLM's CPU build, which has no kernel for the tiny
model's head_dim 16 (a Slurm job's nodes are not judged)."""

def cpu_megatron(*roles: str) -> list[str]:
    """On cluster=local without a GPU the megatron engine's roles are refused too (it needs CUDA)."""
    return [f"roles.{r}.backend: the megatron engine needs CUDA" for r in roles] if CPU_HEAD_DIM else []


SANDBOX_WITHOUT_CODE = "roles.code_sandbox: runs code against a problem's tests, but data.name=synthetic has none"
"""ROLL's mixed example names 8 code_sandbox workers: a train run needs a code task for them."""

GOLDEN_REFUSED: dict[str, list[str]] = {
    "areal_moe_hybrid_32gpu": [CP_HYBRID,
                               "roles.actor_train.backend: 'megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)' lays out routed "
                               "experts in its ffn section (t=4, e=2), but the model has none",
                               VLLM_T8],
    "roll_mixed_cpu_sandbox": [SANDBOX_WITHOUT_CODE],
}
"""Golden sbatch cases (cluster=slurm) this build cannot run -> the start of each line."""

REFUSED: dict[tuple[str, str], list[str]] = {
    ("roles", "areal_megatron_16gpu"): [
        "roles.actor_train.backend: 'megatron:d2p2t4e4' splits the model's routed experts over expert-parallel "
        "ranks e=4, but the model has none", *[
        f"roles.{role}.backend: '{spec}' splits the model's attention over tensor-parallel ranks t=4, but "
        "num_kv_heads=2" for role, spec in (("actor_train", "megatron:d2p2t4e4"), ("reference", "megatron:d2p2t4"))],
        *CPU_HEAD_DIM, *cpu_megatron("actor_train", "reference")],
    ("roles", "areal_moe_hybrid_32gpu"): [*GOLDEN_REFUSED["areal_moe_hybrid_32gpu"], *CPU_HEAD_DIM,
                                          *cpu_megatron("actor_train")],
    ("roles", "ppo_critic_8gpu"): [
        "roles.critic: enabled, but algo.name=grpo does not use a critic (programs that do: ['ppo'])",
        *CPU_HEAD_DIM,
    ],
    ("roles", "roll_mixed_cpu_sandbox"): [*CPU_HEAD_DIM, SANDBOX_WITHOUT_CODE],
    # on CPU: SGLang's CPU engine needs the stand-ins for sgl_kernel (tests/stand_ins, not loaded
    # here); on a GPU beside vLLM: SGLang lives in an environment of its own (docs/sglang.md)
    ("experiment", "arithmetic_sglang"): ["roles.actor_infer.backend: 'sglang:d2' "],
    # a real model: model.path=$(python -m rlbatch.models.bring smollm2) (docs/real-models.md)
    ("experiment", "smollm2_arithmetic"): ["data.chat_template: true needs model.path"],
    ("roles", "areal_16gpu"): ["roles.actor_infer.backend: 'sglang:d2t4' "],
    ("roles", "areal_4rank"): ["roles.actor_infer.backend: 'sglang:t2' "],
    **({("roles", name): CPU_HEAD_DIM for name in ("roll_colocated_8gpu", "roll_disaggregated_8gpu",
                                                    "roll_disaggregated_24gpu")} if CPU_HEAD_DIM else {}),
}
"""Presets this build cannot run -> the start of each line the launcher prints (all of them)."""
PLANNER_COMPANIONS: dict[tuple[str, str], list[str]] = {}
"""What a refused preset needs beside it for the planner to model it."""


@pytest.fixture(scope="module")
def file_data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A model directory and a dataset that exist, for the presets that read local files."""
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")
    return [f"model.path={model}", f"data.path={Path(__file__).parents[1] / 'data' / 'gsm8k_sample.jsonl'}"]


def overrides(group: str, name: str, file_data: list[str]) -> list[str]:
    args = [f"{group}={name}", RUN_DIR]
    return [*args, *file_data] if compose(args).data.name == "file" else args


def refusal(capsys: pytest.CaptureFixture[str], args: list[str]) -> list[str]:
    """The problem lines of a dry run that must be refused."""
    assert main(["dry_run=true", *args]) == 2
    out, err = capsys.readouterr()
    assert "rlbatch placement" not in out and "#SBATCH" not in out
    assert err.startswith("rlbatch: the configuration cannot run:\n") and err.endswith("nothing was started.\n")
    return [ln[len("  - "):] for ln in err.splitlines() if ln.startswith("  - ")]


def assert_lines(lines: list[str], starts: list[str]) -> None:
    assert len(lines) == len(starts), lines
    for start in starts:
        assert sum(ln.startswith(start) for ln in lines) == 1, (start, lines)


def test_every_group_of_presets_is_walked() -> None:
    assert {"roles", "algo", "experiment", "model", "data", "cluster", "hardware"} <= set(GROUPS)
    assert set(REFUSED) <= set(PRESETS), "a refusal is listed for a preset that no longer exists"


@pytest.mark.parametrize(("group", "name"), PRESETS, ids=[f"{g}={n}" for g, n in PRESETS])
def test_every_preset_dry_runs_or_is_refused_naming_what_is_missing(
        group: str, name: str, file_data: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    args = overrides(group, name, file_data)
    if (group, name) in REFUSED:
        assert_lines(refusal(capsys, args), REFUSED[(group, name)])
        check(compose([*args, *PLANNER_COMPANIONS.get((group, name), [])]), runnable=False)  # the planner models it
        return
    assert main(["dry_run=true", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("rlbatch placement:")
    assert ("#SBATCH --nodes=" in out) == (group == "cluster" and name == "slurm")


def test_a_preset_that_reads_local_files_names_them_when_they_are_missing(capsys: pytest.CaptureFixture[str]) -> None:
    lines = refusal(capsys, ["experiment=gsm8k", RUN_DIR, "model.path=/nonexistent/model", "data.path=/nonexistent/x.jsonl"])
    assert_lines(lines, ["model.path: /nonexistent/model does not exist on this machine",
                         "data.path: /nonexistent/x.jsonl does not exist on this machine"])


def test_every_golden_file_has_its_case() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.sh")) == sorted(CASES)
    assert set(GOLDEN_REFUSED) < set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_sbatch_files_are_submitted_as_they_are_or_refused(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["cluster=slurm", "run_dir=/shared/runs/example", *CASES[name]]
    if name in GOLDEN_REFUSED:
        assert_lines(refusal(capsys, args), GOLDEN_REFUSED[name])
        return
    assert main(["dry_run=true", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out.replace(sys.executable, "PYTHON")
    assert (GOLDEN / f"{name}.sh").read_text() in out
