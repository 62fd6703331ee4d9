"""The vLLM benchmarks run end to end at tiny sizes and print their figures
(tools/bench/vllm_engine.py, tools/bench/vllm_vs_hf.py; full-size figures: docs/benchmarks.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--prompts", "2", "--samples", "2", "--prompt-len", "8", "--new-tokens", "4", "--hidden", "64", "--layers", "1",
        "--heads", "2", "--kv-heads", "1", "--ffn", "128", "--vocab", "256", "--kv-cache-mb", "16", "--threads", "1"]

pytestmark = pytest.mark.full  # benchmarks run as tests; each starts vLLM: ~30 s of CPU, minutes of wall time on a loaded machine


def run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / script), *TINY, *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_engine_vs_bare_vllm_generates_the_same_tokens_and_prints_the_ratio() -> None:
    out = run("vllm_engine.py", "--repeats", "1")
    counts = dict(re.findall(r"^(engine|bare)\s.*; (\d+) tokens generated", out, re.M))
    # Same requests, same seed: the engine's output is bare vLLM's, token for token in count.
    assert counts["engine"] == counts["bare"] and 0 < int(counts["engine"]) <= 2 * 2 * 4, out
    assert re.search(r"^ratio engine / bare \(median\): \d+\.\d+x", out, re.M), out


def test_vllm_vs_hf_prints_tokens_per_second_of_each() -> None:
    out = run("vllm_vs_hf.py")
    m = re.search(r"tokens/s \(median of 1\): vllm (\d+), hf (\d+); ratio vllm / hf: (\d+\.\d+)x", out)
    assert m and int(m[1]) > 0 and int(m[2]) > 0, out
