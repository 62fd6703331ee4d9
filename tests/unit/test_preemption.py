"""The loop stops to save and requeue on the preemption signal, or before the walltime deadline;
on SIGINT (Ctrl-C, forwarded by the launcher) it saves and stops without requeueing."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest

from rlbatch.loop import preemption
from rlbatch.loop.preemption import Preemption, install_handler, install_handlers
from rlbatch.runtime.env import read_env

CLUSTER = SimpleNamespace(deadline_margin_s=60.0, preempt_signal="USR2")
SLURM = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURM_NODEID": "0", "SLURM_JOB_END_TIME": str(int(time.time()) + 86400)}


@pytest.fixture(autouse=True)
def _clean() -> None:
    preemption._received.clear()
    yield
    preemption._received.clear()
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    assert p.outcome("signal SIGUSR2") == {"stopped": "preempted", "reason": "signal SIGUSR2"}


@pytest.fixture
def scontrol(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The commands Preemption runs (none really: requeue's scontrol is recorded and succeeds)."""
    calls: list[list[str]] = []
    monkeypatch.setattr(preemption.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or SimpleNamespace(returncode=0, stdout="", stderr=""))
    return calls


def test_preempted_under_slurm_requeues(scontrol: list[list[str]]) -> None:
    install_handler("USR2")
    os.kill(os.getpid(), signal.SIGUSR2)
    p = Preemption(CLUSTER, read_env(SLURM))
    assert p.reason_to_stop(step_s=1, save_s=1) == "signal SIGUSR2" and p.stopped == "preempted"
    assert p.requeue() is True and scontrol[-1] == ["scontrol", "requeue", "42"]


def test_ctrl_c_stops_with_a_checkpoint_and_is_not_requeued(scontrol: list[list[str]]) -> None:
    install_handlers("USR2")
    os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt without the handler
    p = Preemption(CLUSTER, read_env(SLURM))
    assert p.reason_to_stop(step_s=1, save_s=1) == "signal SIGINT"
    assert p.outcome("signal SIGINT") == {"stopped": "interrupted", "reason": "signal SIGINT"}
    assert p.requeue() is False and not any(c[:2] == ["scontrol", "requeue"] for c in scontrol)


def test_ctrl_c_outranks_a_preemption_but_not_when_it_is_the_preemption_signal() -> None:
    install_handlers("USR2")
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGINT)
    p = Preemption(CLUSTER, read_env({}))
    assert p.reason_to_stop(step_s=1, save_s=1) == "signal SIGINT" and p.stopped == "interrupted"
    preemption._received[:] = ["SIGINT"]
    q = Preemption(SimpleNamespace(deadline_margin_s=60.0, preempt_signal="INT"), read_env({}))
    assert q.reason_to_stop(step_s=1, save_s=1) == "signal SIGINT" and q.stopped == "preempted"


def test_nothing_recorded_when_the_run_ends_at_its_last_step() -> None:
    p = Preemption(CLUSTER, read_env({}))
    assert p.reason_to_stop(step_s=1, save_s=1) is None and p.outcome(None) == {}
