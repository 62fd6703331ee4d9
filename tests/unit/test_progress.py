"""What a user watching a run sees: one line per step in the controller's log (the Slurm output
file under ``tail -f``), besides metrics.jsonl."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rlbatch.loop.metrics import Metrics, progress_line
from rlbatch.runtime.rundir import RunDir


def test_each_step_logs_one_line_with_reward_phases_and_time_left(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics(RunDir(tmp_path), steps=10, tensorboard=False)
    rows = [{"step": 0, "reward_mean": 0.125, "time/step": 4.0, "time/generate": 1.5, "time/train": 2.25,
             "time/offload": 0.1},
            {"step": 1, "reward_mean": 0.5, "time/step": 2.0, "eval/all/pass@1": 0.3125}]
    with caplog.at_level(logging.INFO, logger="rlbatch.loop.metrics"):
        for row in rows:
            metrics.log(row)
    assert [r.getMessage() for r in caplog.records if r.name == "rlbatch.loop.metrics"] == [
        "step 1/10; reward 0.125; 4.0s (generate 1.5s, train 2.2s); about 36s left",
        "step 2/10; reward 0.500; held-out pass@1 0.312; 2.0s; about 24s left",  # 8 steps left at the mean 3 s
    ]
    assert progress_line({"step": 9, "reward_mean": 1.0, "time/step": 90.0}, 10, []) == "step 10/10; reward 1.000; 90.0s"
    assert progress_line({"step": 0, "reward_mean": 0.0, "time/step": 100.0}, 100, [{"time/step": 100.0}]).endswith(
        "about 2h45m left")
