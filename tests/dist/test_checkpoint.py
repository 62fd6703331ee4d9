"""Checkpoints of FSDP2 train state on real processes (mpiexec + gloo): exact resume, resharding,
a rank killed mid-write, and export to a Hugging Face directory."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlbatch.checkpoint import CheckpointStore
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.dist
SCRIPTS = Path(__file__).parent / "scripts"


def mpirun(script: str, n: int, *args: str | Path) -> subprocess.CompletedProcess[str]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    port = str(random.Random(f"{script}{args}").randrange(30000, 40000) + os.getpid() % 1000)
    return subprocess.run([str(mpiexec), "-n", str(n), sys.executable, str(SCRIPTS / script), port, *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=180)


def ok(out: subprocess.CompletedProcess[str], marker: str, n: int) -> None:
    assert out.returncode == 0 and out.stdout.count(marker) == n, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ckpt_resume.py's output: a 2-rank run dir with checkpoints at steps 3 and 6, and references."""
    out = tmp_path_factory.mktemp("resume")
    ok(mpirun("ckpt_resume.py", 2, out), "resume ok", 2)
    return out


def test_resume_from_a_checkpoint_continues_bit_for_bit(resumed: Path) -> None:
    ckpt = resumed / "run/checkpoints/step_000003"
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert files == ["actor_train/.metadata", "actor_train/__0_0.distcp", "actor_train/__1_0.distcp",
                     "actor_train/engine_meta.pt", "config.yaml", "controller.json", "manifest.json",
                     "rng/rank0.pt", "rng/rank1.pt"]  # no reference/: forward-only roles are not saved


def test_a_two_rank_checkpoint_loads_into_one_rank(resumed: Path) -> None:
    out = mpirun("ckpt_reshard.py", 1, resumed / "run/checkpoints/step_000003", resumed / "ref_step3.pt", 3)
    ok(out, "reshard ok (1 ranks, step_000003)", 1)


def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path: Path) -> None:
    out = mpirun("ckpt_kill.py", 2, tmp_path)
    assert out.returncode != 0 and "SIGKILL while writing step 3" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert "should not get here" not in out.stdout
    store = CheckpointStore(tmp_path / "run/checkpoints")
    scan = store.scan()
    assert scan.checkpoint is not None and scan.checkpoint.step == 2
    assert len(scan.skipped) == 1 and "step_000003.tmp-" in scan.skipped[0] and "never committed" in scan.skipped[0]
    ok(mpirun("ckpt_reshard.py", 1, tmp_path / "run", tmp_path / "ref_step2.pt", 2), "reshard ok (1 ranks, step_000002)", 1)
    stage = store.begin(3)  # the resumed run writes step 3 again; its commit drops the dead attempt
    (stage / "controller.json").write_text("{}")
    store.commit(3)
    assert sorted(p.name for p in store.root.iterdir()) == ["step_000002", "step_000003"]


def test_export_writes_a_model_transformers_loads_with_the_trained_logits(resumed: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbatch.export import main

    assert main([str(resumed / "run"), str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    assert "step_000006 (step 6)" in printed and "model.safetensors" in printed
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        logits = model(input_ids=torch.arange(4, 18).reshape(2, 7)).logits  # ckpt_common.probe()
    assert torch.equal(logits, torch.load(resumed / "logits_step6.pt"))
    assert tok.decode(tok("12+3=")["input_ids"], skip_special_tokens=True) == "12+3="

    assert main([str(resumed / "nowhere"), str(tmp_path / "x")]) == 2
    assert "no such checkpoint or run directory" in capsys.readouterr().err
    assert main([str(resumed / "run/checkpoints/step_000003"), str(tmp_path / "hf")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_rng_states_round_trip(tmp_path: Path) -> None:
    from rlbatch.checkpoint.dcp import load_rng, save_rng

    def draw() -> tuple[float, float, float]:
        return torch.rand(()).item(), float(np.random.rand()), random.random()

    save_rng(tmp_path, 5)
    first = draw()
    draw()
    assert load_rng(tmp_path, 5) and draw() == first
    assert not load_rng(tmp_path, 6)
