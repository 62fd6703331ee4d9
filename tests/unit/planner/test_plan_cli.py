"""The command line: predict tables and JSON, bad configs, search lines, calibrate then report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MODELS, make_config, roles
from synthetic_runs import write_run

from rlbatch.plan.__main__ import main

Q7B = f"model.path={MODELS / 'qwen2_5_7b'}"


def test_default_experiment_prints_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for text in ("state per GPU", "memory per GPU", "time per phase", "peak:", "dominant:", "step:", "verdict: FITS"):
        assert text in out


def test_json_output_and_the_cpu_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["predict", "hardware=cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"] == "cpu" and data["fits"] is True
    assert [p["name"] for p in data["phases"]] == ["generate", "score", "ref_logprobs", "old_logprobs", "train", "sync"]
    assert data["step_s"] >= max(p["end"] for p in data["phases"])


def test_an_oom_exits_1_with_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([Q7B, "roles=roll_colocated_8gpu", "hardware.hbm_bytes=24e9"]) == 1
    out = capsys.readouterr().out
    assert "verdict: DOES NOT FIT" in out and "OOM on GPU ranks 0-7" in out and "GiB usable" in out


def test_bad_configuration_exits_2_with_every_problem(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roles.actor_train.backend=fsdp:d3", "algo.samples_per_prompt=1"]) == 2
    err = capsys.readouterr().err
    assert "nothing was started" in err and "roles.actor_train" in err and "samples_per_prompt" in err
    assert main(["hardware=tpu_v9"]) == 2
    assert "no profile 'tpu_v9'" in capsys.readouterr().err


def test_search_prints_ranked_override_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", Q7B, "roles=roll_colocated_8gpu", "algo.max_new_tokens=1024", "algo.grad_accum=8",
                 "algo.prompts_per_step=16", "algo.samples_per_prompt=8",
                 "--top", "2", "--prompt-len", "512"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("searched ") and "# 1:" in out and "# 2:" in out
    assert "'roles.actor_train.device_mapping=\"list(range(0," in out


def test_calibrate_then_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(tmp_path / "a", make_config())
    b = write_run(tmp_path / "b", make_config(roles=roles("fsdp:d1", "hf:d1", [0], [1])), seed=1)
    profile = tmp_path / "profile.yaml"
    assert main(["calibrate", str(a), "-o", str(profile)]) == 0
    assert "hardware cpu" in capsys.readouterr().out  # chosen because the run reported no GPU memory
    assert main(["report", str(b), "--profile", str(profile), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_mape"] < 0.10 and "time/generate" in data["runs"][0]["mape"]
    assert main(["report", str(b), "--profile", str(profile)]) == 0
    assert "step-time MAPE over 1 run(s)" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_the_planner_never_imports_torch() -> None:
    code = ("import sys; from rlbatch.plan.__main__ import main; rc = main(['--json']); "
            "sys.exit(3 if 'torch' in sys.modules else rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[3])
    assert res.returncode == 0, res.stderr[-2000:]


def test_dynamic_sampling_rounds_are_printed_and_the_fraction_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["algo=dapo", "--zero-variance-frac", "0"]) == 0
    assert "dynamic sampling: 1.00 expected generate+score rounds per step" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["algo=dapo", "--zero-variance-frac", "1.5"])
    assert e.value.code == 2 and "--zero-variance-frac is a share of groups, in [0, 1]; got 1.5" in capsys.readouterr().err
