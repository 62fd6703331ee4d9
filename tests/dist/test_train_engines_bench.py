"""tools/bench/train_engines.py --quick on 2 ranks (mpiexec, gloo): fsdp, deepspeed ZeRO-1 and
megatron TP=1 (data-parallel over both ranks) and TP=2 each train the same tiny model on the same
batch, the table parses, and the engines' losses agree to float32 rounding while training moved them;
fsdp with LoRA adapters starts from the same loss, trains fewer parameters and syncs the merged model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.dist, pytest.mark.full]  # a benchmark run as a test

TIMEOUT_S = 400
"""~20-30 s of CPU per rank, most of it importing torch, transformers, DeepSpeed and megatron-core;
80-105 s of wall time on 2 cores at load average 4-12 (other programs beside it). The limit is for a hang."""

TOL = 1e-4
"""The losses are float32 means over the 32 response tokens of the quick batch of exp(logp - old)
* advantage (|advantage| < 3) plus 0.01 * KL. Each engine sums the same products in another order
(FSDP2 and ZeRO reduce-scatter/all-reduce the gradients, TP=2 splits every matmul and the vocab),
so a token's log-prob (|logp| ~ 5.5, a log-sum-exp over 256 logits of 64-term dot products) differs
by a few units of 2^-24 * 5.5 * sqrt(64), ~1e-6, and so does the loss. Three AdamW updates at lr
1e-3 do not amplify it: Adam's step is relative to the gradient, so a relative gradient difference
of 1e-6 moves the weights by ~1e-9. 1e-4 leaves a 100x margin; one update skipped or applied twice
moves "loss after" by ~5e-3 (the quick run's last update moves it 4.7e-3), 50x the tolerance."""


def _table(stdout: str) -> list[dict[str, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(lines) >= 3 and set(lines[1]) <= set("|-"), stdout[-3000:]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def test_quick_run_of_five_engine_configs_prints_a_table_with_equal_losses() -> None:
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tools/bench/train_engines.py"), "--quick",
                          "--engines", "fsdp,zero1,tp1,tp2,pp2,fsdp_lora"], capture_output=True, text=True,
                         timeout=TIMEOUT_S, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _table(out.stdout)
    # LoRA (adapters start at zero: the base model's first loss), its adapters the only trained
    # weights, its sync the merged model's bytes; it trains other weights, so "loss after" is its own
    lora = rows.pop()
    assert (lora["engine"], lora["config"]) == ("fsdp", "FSDP2 d2, LoRA r16"), lora
    assert abs(float(lora["loss step 1"]) - float(rows[0]["loss step 1"])) <= TOL, (lora, rows[0])
    assert float(lora["trained params"].rstrip("M")) < 0.5 * float(rows[0]["trained params"].rstrip("M")), (lora, rows[0])
    assert lora["sync MiB"] == rows[0]["sync MiB"] and float(lora["sync MiB"]) > 0, (lora, rows[0])
    assert [(r["engine"], r["config"]) for r in rows] == [("fsdp", "FSDP2 d2"), ("deepspeed", "ZeRO-1 d2"),
                                                           ("megatron", "TP=1 d2"), ("megatron", "TP=2 t2"),
                                                           ("megatron", "PP=2 p2")], out.stdout[-3000:]
    for r in rows:
        assert float(r["s/step"]) > 0 and float(r["peak RSS MiB/rank"]) > 0, r
        assert r["MFU"] == "-", r  # CPU: no MFU
    for column in ("loss step 1", "loss after"):
        values = [float(r[column]) for r in rows]
        assert max(values) - min(values) <= TOL, (column, values)
    first, after = float(rows[0]["loss step 1"]), float(rows[0]["loss after"])
    assert abs(after - first) > 100 * TOL, f"training did not move the loss: {first} -> {after}"
    assert "step 3 " in out.stdout and "(warm-up)" in out.stdout  # progress lines, one per step
