"""``python -m rlbatch.launch dry_run=true``: what a user sees, in a real subprocess.

Every run uses cwd=tmp_path, so nothing is written into the repository and a test can check
that a dry run writes nothing at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "transformers", "vllm", "deepspeed", "megatron", "sglang")


def launch(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlbatch.launch", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_dry_run_prints_the_placement_and_the_slurm_request(tmp_path: Path, cli_env: dict[str, str]) -> None:
    # program=selftest starts no engine, so a placement with vllm (not in this build) dry-runs.
    proc = launch(["dry_run=true", "program=selftest", "roles=roll_mixed_cpu_sandbox"], tmp_path, cli_env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for role in ("actor_train", "actor_infer", "reference", "reward", "code_sandbox"):
        assert role in out
    assert "Slurm request: --nodes=2" in out and "--gres=gpu:8" in out
    assert "16 GPU ranks on 2 node(s)" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("actor_infer"))
    assert row.split()[:6] == ["actor_infer", "vllm", "d6t2", "0-11", "0-1", "6"]
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_dry_run_does_not_create_the_run_directory(run_root: Path, cli_env: dict[str, str]) -> None:
    # run_root, not tmp_path: cluster=slurm refuses a run directory under /tmp.
    for args in (["dry_run=true"], ["dry_run=true", "run_dir=my_run"], ["dry_run=true", "cluster=slurm"]):
        proc = launch(args, run_root, cli_env)
        assert proc.returncode == 0, proc.stderr
        assert "Slurm request" in proc.stdout
    assert list(run_root.iterdir()) == []  # no runs/, my_run/, outputs/ or .hydra/


def test_bad_config_exits_2_and_lists_every_problem(tmp_path: Path, cli_env: dict[str, str]) -> None:
    proc = launch(
        [
            "dry_run=true",
            'roles.actor_train.device_mapping="[0, 0]"',
            "roles.actor_infer.backend=tgi:d2",
            "roles.reference.device_mapping=[0,1,2,3]",
            "algo.samples_per_prompt=1",
        ],
        tmp_path, cli_env,
    )
    assert proc.returncode == 2
    err = proc.stderr
    for fragment in (
        "roles.actor_train.device_mapping: GPU ranks listed more than once: [0]",
        "roles.actor_infer.backend: unknown engine 'tgi'",
        "roles.reference: device_mapping has 4 GPUs but backend 'fsdp:d2' needs",
        "algo.samples_per_prompt: algo.advantage=grpo compares each sample with the others of its prompt",
    ):
        assert fragment in err, err
    assert sum(ln.startswith("  - ") for ln in err.splitlines()) == 4, err
    assert "nothing was started" in err
    assert "Traceback" not in err and "Traceback" not in proc.stdout
    assert "Slurm request" not in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_override_syntax_errors_exit_2_without_traceback(tmp_path: Path, cli_env: dict[str, str]) -> None:
    for bad in ("roles.actor_train.device_mapping=list(range(0,16))", "roles.actor_train.foo=1", "roles=nope"):
        proc = launch(["dry_run=true", bad], tmp_path, cli_env)
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
        assert "overrides:" in proc.stderr and "Traceback" not in proc.stderr


def test_a_syntax_error_names_the_override_it_is_in(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Among several overrides, the one Hydra's grammar refuses is named with its text and place."""
    proc = launch(["dry_run=true", "steps=3", "algo.lr=[1,", "seed=2"], tmp_path, cli_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "overrides: 'algo.lr=[1,' (argument 3 of 4): no viable alternative at input '[1,'" in proc.stderr, proc.stderr


def test_documented_quoting_works_from_a_shell(tmp_path: Path, cli_env: dict[str, str]) -> None:
    command = (
        f"{sys.executable} -m rlbatch.launch dry_run=true"
        " 'roles.actor_train.device_mapping=\"list(range(0,16))\"' roles.actor_train.backend=fsdp:d16"
        " 'roles.actor_infer.device_mapping=\"list(range(0,16))\"' roles.actor_infer.backend=hf:d16"
        " 'roles.reference.device_mapping=\"list(range(0,16))\"'"
    )
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines() if ln.startswith(("actor_", "reference"))}
    assert rows["actor_train"][:6] == ["actor_train", "fsdp", "d16", "0-15", "0-1", "16"]
    assert rows["actor_infer"][:7] == ["actor_infer", "hf", "d16", "0-15", "0-1", "16", "1"]
    assert rows["reference"][:6] == ["reference", "fsdp", "d16", "0-15", "0-1", "16"]
    assert "16 GPU ranks on 2 node(s)" in proc.stdout
    assert "Slurm request: --nodes=2" in proc.stdout


_PROBE = """
import json, sys
from rlbatch.launch.__main__ import main
codes = [
    main(["dry_run=true"]),
    main(["dry_run=true", "roles=areal_megatron_16gpu"]),  # refused: megatron's e is not built
    main(["dry_run=true", "program=selftest", "roles=areal_moe_hybrid_32gpu", "cluster=slurm",
          "run_dir=/shared/runs/probe"]),
    main(["dry_run=true", "roles.actor_infer.backend=vllm:d9"]),
]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
print("PROBE" + json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_dry_run_imports_no_engine(tmp_path: Path, cli_env: dict[str, str]) -> None:
    code = f"HEAVY = {HEAVY!r}\n{_PROBE}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE"))
    result = json.loads(line[len("PROBE"):])
    assert result["codes"] == [0, 2, 0, 2]
    assert result["heavy"] == []
    assert list(tmp_path.iterdir()) == []


def test_plan_imports_no_engine(tmp_path: Path, cli_env: dict[str, str]) -> None:
    code = (
        "import sys\n"
        "from rlbatch.placement import place\n"
        "from rlbatch.checks.validate import check\n"
        "cfg = {'resume': 'auto', 'roles': {"
        "'actor_train': {'device_mapping': 'range(16)', 'backend': 'megatron:d2p2t4e4'},"
        "'actor_infer': {'device_mapping': 'range(16)', 'backend': 'vllm:d4t4'},"
        "'reference': {'device_mapping': 'range(16)', 'backend': 'deepspeed:d16'}}}\n"
        "check(cfg, runnable=False)\n"
        "try:\n"
        "    check(cfg)\n"
        "except ValueError as e:\n"
        "    assert 'expert-parallel ranks e=4, but the model has none' in str(e), e\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} + ('hydra', 'omegaconf')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_help_opens_with_rlbatch_usage_and_lists_every_preset(tmp_path: Path, cli_env: dict[str, str]) -> None:
    from rlbatch.launch.usage import groups

    proc = launch(["--help"], tmp_path, cli_env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m rlbatch.launch")
    assert "powered by Hydra" not in proc.stdout
    presets = groups()
    assert {"algo", "experiment", "roles", "cluster"} <= set(presets)
    for name, names in presets.items():
        assert f"{name}:" in proc.stdout and all(n in proc.stdout for n in names)
    assert not any(tmp_path.iterdir())  # nothing written
    hydra = launch(["--hydra-help"], tmp_path, cli_env)
    assert hydra.returncode == 0 and "Hydra" in hydra.stdout
