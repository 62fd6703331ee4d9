"""The GRPO pipeline with vLLM as actor_infer (vLLM's CPU build here): colocated with actor_train
on both ranks (``vllm:d2``, weight sync in process) and on a rank of its own (``vllm:d1``, weight
sync broadcast in buckets to the one rank that holds a vLLM engine). A tensor-parallel vLLM
worker (t=2) on the job's ranks 0-1 and on ranks 1-2 of 3 (not on rank 0): greedy output equals
transformers' before and after a weight sync, and both peers sample alike; the same with the
engine compiled (``cpu_compile``), and with a Mixture-of-Experts model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch, rank_logs
from tests.dist.test_mechanisms import mpirun

pytestmark = pytest.mark.dist
# vLLM's CPU attention needs head_dim >= 32: the default tiny model (hidden 64) with 2 heads
MODEL = ["model.num_heads=2", "model.num_kv_heads=1"]


@pytest.mark.parametrize(("roles", "backend"), [("colocated", "vllm:d2"),
                                                  pytest.param("disaggregated", "vllm:d1", marks=pytest.mark.full)])
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


@pytest.mark.full
@pytest.mark.parametrize(("ranks", "args"), [(2, ["0,1"]), (3, ["1,2"]), (2, ["0,1", "compiled"]), (2, ["0,1", "moe"])],
                         ids=["colocated-d1t2", "subset-t2", "colocated-d1t2-compiled", "colocated-d1t2-moe"])
def test_tensor_parallel_vllm_worker_matches_transformers(ranks: int, args: list[str]) -> None:
    out = mpirun("vllm_tp.py", ranks, *args)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("vllm tp ok") == ranks, out.stdout[-2000:]

