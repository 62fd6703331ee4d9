"""The GRPO pipeline with vLLM as actor_infer (vLLM's CPU build here): colocated with actor_train
on both ranks (``vllm:d2``, weight sync in process) and on a rank of its own (``vllm:d1``, weight
sync broadcast in buckets to the one rank that holds a vLLM engine). A tensor-parallel vLLM
worker (t=2) on the job's ranks 0-1 and on ranks 1-2 of 3 (not on rank 0): greedy output equals
transformers' before and after a weight sync, and both peers sample alike. A compiled engine
(``cpu_compile``) equals transformers too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, launch, rank_logs
from tests.dist.test_mechanisms import mpirun

pytestmark = [pytest.mark.dist, pytest.mark.slow]
# vLLM's CPU attention needs head_dim >= 32: the default tiny model (hidden 64) with 2 heads
MODEL = ["model.num_heads=2", "model.num_kv_heads=1"]


@pytest.mark.parametrize(("roles", "backend"), [("colocated", "vllm:d2"), ("disaggregated", "vllm:d1")])
def test_grpo_with_vllm_generating(run_root: Path, roles: str, backend: str) -> None:
    run = run_root / "run"
    out = launch([f"roles={roles}", f"roles.actor_infer.backend={backend}", *MODEL, "steps=3", f"run_dir={run}"],
                 run_root, timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "done: 3 steps" in out.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["tokens/generated"] > 0 for r in rows)
    logs = rank_logs(run)
    assert logs.count("built vllm engine for actor_infer") == (2 if roles == "colocated" else 1)


@pytest.mark.parametrize(("ranks", "peers"), [(2, "0,1"), (3, "1,2")], ids=["colocated-d1t2", "subset-t2"])
def test_tensor_parallel_vllm_worker_matches_transformers(ranks: int, peers: str) -> None:
    out = mpirun("vllm_tp.py", ranks, peers)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("vllm tp ok") == ranks, out.stdout[-2000:]


def test_a_compiled_cpu_engine_equals_transformers_before_and_after_a_sync(tmp_path: Path) -> None:
    """engine_args.cpu_compile: vLLM's torch.compile on CPU (~30 s more start-up), same outputs."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests/dist/scripts/vllm_compiled.py"), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "vllm compiled ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
