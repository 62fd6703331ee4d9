"""The loop stops to save and requeue on the preemption signal, or before the walltime deadline."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from rlbatch.runtime.env import read_env
from rlbatch.scheduler import preemption
from rlbatch.scheduler.preemption import Preemption, install_handler

CLUSTER = SimpleNamespace(deadline_margin_s=60.0)


@pytest.fixture(autouse=True)
def _clean() -> None:
    preemption._received.clear()
    yield
    preemption._received.clear()
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def test_no_reason_outside_slurm_and_far_from_any_deadline() -> None:
    p = Preemption(CLUSTER, read_env({}))
    assert p.end is None
    assert p.reason_to_stop(step_s=5, save_s=5) is None
    assert p.requeue() is False  # nothing to requeue outside Slurm


def test_deadline_triggers_before_the_time_limit_without_a_signal() -> None:
    env = read_env({"SLURM_JOB_END_TIME": str(int(time.time()) + 100)})
    p = Preemption(CLUSTER, env)
    assert p.reason_to_stop(step_s=10, save_s=5) is None  # 100 s left > 10 + 5 + 60
    reason = p.reason_to_stop(step_s=30, save_s=20)         # 30 + 20 + 60 > 100 s left
    assert reason is not None and reason.startswith("deadline")


def test_the_preemption_signal_is_recorded_not_fatal() -> None:
    install_handler("USR2")
    os.kill(os.getpid(), signal.SIGUSR2)  # would end the process without the handler
    p = Preemption(CLUSTER, read_env({}))
    assert p.reason_to_stop(step_s=1, save_s=1) == "signal SIGUSR2"
