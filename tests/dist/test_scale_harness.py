"""``tools/bench/scale.py`` at 4 GPU ranks, a real run of the launcher, the controller and the GRPO
loop with the ``sleep`` engines: the ranks are as light as the runtime makes them. No rank starts a
torch.distributed world (the sleep engines need none: the samples move over MPI), the ranks are
forked from their node's zygote (``rlbatch.runtime.zygote``) and share torch's pages, and what
goes through the controller is what it was (6 messages a rank a step, plus 26). Counted in bytes
and messages, not timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[2]
RANKS = 4
ALONE_PSS_MB = 170
"""A rank of this run started on its own (each imports torch): 177-218 MB PSS measured."""


def test_a_sleep_engine_world_runs_without_torch_distributed_on_forked_ranks(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "tools/bench/scale.py"), "--ranks", str(RANKS), "--steps", "3",
                          "--out", str(tmp_path), "--json", str(tmp_path / "scale.json"), "--timeout", "240"],
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith(f"scale: {RANKS} ranks, control overhead ")
    [result] = json.loads((tmp_path / "scale.json").read_text())["results"]
    assert result["ctl_msgs"] == 12 * RANKS + 2  # a command and a reply per GPU rank and phase (6), the scoring's 2
    assert 0 < result["ctl_busy_ms"] <= result["ctl_cpu_ms"]  # the polls while ranks work counted apart
    assert result["pss_mb_per_rank"] < 0.7 * ALONE_PSS_MB, result  # torch's pages shared, not one copy a rank
    logs = sorted((tmp_path / f"r{RANKS}_s4" / "logs").glob("rank*.log"))
    assert len(logs) == RANKS + 2  # the GPU ranks, the reward worker, the controller
    for log in logs:
        assert "no torch.distributed world" in log.read_text(), log.name
    assert list((tmp_path / f"r{RANKS}_s4").glob("zygote-*.log"))
