"""tools/bench/ end to end on tiny workloads: vs_trl.py runs TRL and rlbatch (2 ranks and a
--baseline checkout beside it; 1 rank with vLLM on both sides) and ends with the speedup line;
overheads.py prints every ratio; async.py runs each staleness and ends with its speedup line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.dist, pytest.mark.full]  # the benchmarks run as tests


def test_vs_trl_runs_both_frameworks_on_the_same_workload(run_root: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools/bench/vs_trl.py"), "--steps", "3", "--prompts", "4",
                          "--samples", "4", "--ranks", "2", "--out", str(run_root / "bench"), "--baseline", str(REPO_ROOT)],
                         capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("speedup vs TRL: ") and last.endswith("x"), last
    result = json.loads((run_root / "bench" / "results.json").read_text())
    assert [r["name"] for r in result["results"]] == ["TRL GRPOTrainer", "rlbatch 2 ranks", "baseline 2 ranks"]
    assert all(r["steps"] == 3 and r["samples_per_s"] > 0 for r in result["results"])
    assert "this checkout vs --baseline: " in out.stdout  # --baseline: here the same checkout, run alongside
    assert result["settings"]["samples_per_prompt"] == 4 and result["settings"]["prompts_per_step"] == 4
    ours = [r for r in result["results"] if r["name"].startswith("rlbatch")]
    speedup = max(r["samples_per_s"] for r in ours) / result["results"][0]["samples_per_s"]
    assert last == f"speedup vs TRL: {speedup:.2f}x"
    assert (run_root / "bench" / "reward_curves.png").stat().st_size > 0


def test_async_bench_runs_each_staleness_and_ends_with_the_speedup(run_root: Path) -> None:
    """Tiny sizes, hf rollouts, the reference on the inference rank (its default): every setting
    launches and trains at its staleness, and the last line is the speedup of max_staleness=1."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools/bench/async.py"), "--steps", "4", "--warmup", "1",
                          "--staleness", "1", "--infer", "hf:d1", "--hidden", "64", "--layers", "2", "--heads", "4",
                          "--kv-heads", "2", "--max-new-tokens", "2", "--prompts", "4", "--samples", "4",
                          "--out", str(run_root / "bench")], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run_root / "bench" / "results.json").read_text())
    assert "roles.reference.device_mapping=[1]" in result["workload"]
    runs = {name: r["runs"][0] for name, r in result["results"].items()}
    assert runs["max_staleness=0"]["staleness"] == [0.0] and runs["max_staleness=1"]["staleness"] == [0.0, 1.0]
    speedup = result["results"]["max_staleness=1"]["samples_per_s"] / result["results"]["max_staleness=0"]["samples_per_s"]
    assert out.stdout.strip().splitlines()[-1] == f"async speedup: {speedup:.2f}x"
    assert (run_root / "bench" / "timeline.png").stat().st_size > 0


def test_async_bench_long_tail_workload_learns_by_the_leading_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """--workload long-tail: the small model vLLM's CPU attention takes, 8 prompts x 16 samples, up to
    256 new tokens and the reward that lets long responses score; explicit options still win."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_async", REPO_ROOT / "tools/bench/async.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["async.py", "--in-flight", "--workload", "long-tail", "--samples", "4"])
    a = bench.parse()
    ov = bench.overrides(a, 2)
    for want in ("model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "algo.max_new_tokens=256",
                 "algo.prompts_per_step=8", "algo.samples_per_prompt=4",
                 "data.reward_fn=rlbatch.rewards.rules:leading_number_match", "algo.off_policy=tis"):
        assert want in ov, (want, ov)
    assert a.threshold == 0.1
    monkeypatch.setattr(sys, "argv", ["async.py"])
    default = bench.overrides(bench.parse(), 0)
    assert "model.hidden_size=256" in default and not any(o.startswith("data.reward_fn=") for o in default)


def test_overheads_prints_every_ratio() -> None:
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools/bench/overheads.py"), "--ranks", "3", "--mb", "1",
                          "--iters", "3"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {line.split(" ours ")[0].strip(): line for line in out.stdout.splitlines() if " ratio " in line}
    assert set(rows) == {"control plane round trip", "control floor: bare send/recv", "data plane vs send/recv",
                         "data plane vs broadcast", "offload + reload", "weight sync"}, out.stdout
    for line in rows.values():  # a number each (0.00x where ours is far below a raw time a busy machine stretched)
        ours, raw = (float(line.split(k, 1)[1].split()[0]) for k in (" ours ", " raw "))
        ratio = float(line.rsplit("ratio", 1)[1].strip().rstrip("x"))
        assert ours > 0 and raw > 0 and ratio >= 0, line


def test_vs_trl_long_workload_with_vllm_on_both_sides(run_root: Path) -> None:
    """--workload long --engine vllm: TRL's colocated vLLM and rlbatch's vllm engine, tiny sizes, both
    starting from the warm start's exported model."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools/bench/vs_trl.py"), "--workload", "long", "--engine", "vllm",
                          "--steps", "2", "--prompts", "2", "--samples", "4", "--max-new-tokens", "8", "--ranks", "1",
                          "--warm-start-steps", "1", "--kv-cache-gb", "1", "--out", str(run_root / "bench")],
                         capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("speedup vs TRL: ")
    result = json.loads((run_root / "bench" / "results.json").read_text())
    assert [r["name"] for r in result["results"]] == ["TRL GRPOTrainer", "rlbatch 1 rank"]
    assert all(r["steps"] == 2 and r["samples_per_s"] > 0 for r in result["results"])
    assert result["settings"]["reward_fn"].endswith(":answer_repeated")
    bound = result["arithmetic"]  # the arithmetic bound, printed before the last line
    assert set(bound["runs"]) == {"TRL GRPOTrainer", "rlbatch 1 rank"} and bound["peak_gflop_per_s"] > 0
    assert all(0 < r["gflop_per_s"] < bound["peak_gflop_per_s"] for r in bound["runs"].values()), bound
    assert re.search(rf"^ceiling vs TRL at this arithmetic: {bound['ceiling']:.2f}x", out.stdout, re.M), out.stdout[-3000:]
    assert "4 heads (1 kv)" in result["settings"]["model"]
    assert result["settings"]["start"].startswith("warm start: 1 steps")
    warm = run_root / "bench" / "warm-start"
    assert len((warm / "metrics.jsonl").read_text().splitlines()) == 1
    spec = json.loads((run_root / "bench" / "trl_spec.json").read_text())
    assert spec["model_dir"] == str(run_root / "bench" / "warm-start-model")
    assert f"model.path={run_root / 'bench' / 'warm-start-model'}" in out.stdout  # rlbatch starts from it too
    logs = (run_root / "bench" / "rlbatch-1rank" / "logs" / "rank0.log").read_text()
    assert re.search(r"vLLM actor_infer engine started in [0-9.]+s \(CPU, torch.float32, compiled, t=1\)", logs), logs[-3000:]
