"""cluster=slurm without a cluster: a stand-in ``sbatch`` on PATH refuses the job the way the real
one does (tests/slurm/test_slurm_submit.py does it against the real one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.launch.slurm import sbatch_refusal, submit

REFUSAL = ("sbatch: error: invalid partition specified: nope\n"
           "sbatch: error: Batch job submission failed: Invalid partition name specified\n")


def test_sbatch_refusal_keeps_sbatchs_words_on_one_line() -> None:
    assert sbatch_refusal(REFUSAL) == ("invalid partition specified: nope; "
                                       "Batch job submission failed: Invalid partition name specified")
    assert sbatch_refusal("") == "no reason given"


def test_a_refused_submission_is_one_stderr_line_exit_2_and_no_debris(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\nprintf '{REFUSAL}' >&2\nexit 1\n")
    # submitit looks for srun before it submits: a stand-in, so that the test needs no Slurm install
    # (the job is refused, so nothing ever runs it)
    (bin_dir / "srun").write_text("#!/bin/sh\necho 'srun: not expected to run' >&2\nexit 1\n")
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    cfg = compose(["cluster=slurm", "cluster.partition=nope", f"run_dir={run}"])
    assert submit(cfg, check(cfg, runnable=False)) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "rlbatch: sbatch refused the job: invalid partition specified: nope; "
        "Batch job submission failed: Invalid partition name specified; nothing was submitted"]
    assert "submitted" not in out
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "logs", "placement.json", "rlbatch.lock"]


def test_no_slurm_commands_is_one_line_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no sbatch
    cfg = compose(["cluster=slurm", f"run_dir={tmp_path / 'run'}"])
    assert submit(cfg, check(cfg, runnable=False)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rlbatch: cannot submit to Slurm here: ") and line.endswith("; nothing was submitted")
    assert "srun" in line
