"""The guarded episode: an env that raises, hangs, returns garbage or plays too long ends its own
trajectory with its reason, the caller gets control back within the step timeout, and an
episode beside it plays on."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from rlbatch.envs.base import END_REASONS, StepResult
from rlbatch.envs.episode import Episode, EpisodeLimits, abandoned_calls
from rlbatch.envs.running_sum import RunningSum

TIMEOUT_S = 1.0
"""The step timeout of the hanging cases; the caller must be back within it plus SLACK_S."""
SLACK_S = 1.5
"""Thread start and join on a loaded 2-core machine (milliseconds when idle)."""
FOREVER = threading.Event()  # never set: a wait on it hangs for good


class Scripted:
    """An env whose step does what ``behaviour`` says, after one good step."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.calls = 0

    def reset(self, task: Mapping[str, Any], seed: int) -> Any:
        if self.behaviour == "reset raises":
            raise RuntimeError("no such task")
        if self.behaviour == "reset hangs":
            FOREVER.wait()
        if self.behaviour == "reset garbage":
            return b"bytes"
        return "go"

    def step(self, action: str) -> Any:
        self.calls += 1
        if self.calls == 1:
            return StepResult("again", 0.5, False)
        if self.behaviour == "raises":
            return 1 / 0
        if self.behaviour == "exits":
            raise SystemExit(3)
        if self.behaviour == "hangs":
            FOREVER.wait()
        return GARBAGE[self.behaviour]()


class BadRepr:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("boom")


GARBAGE: dict[str, Any] = {
    "nan reward": lambda: StepResult("x", math.nan, False),
    "inf reward": lambda: StepResult("x", math.inf, False),
    "text reward": lambda: StepResult("x", "1", False),  # type: ignore[arg-type]
    "observation not text": lambda: StepResult(["x"], 0.0, False),  # type: ignore[arg-type]
    "done not bool": lambda: StepResult("x", 0.0, "yes"),  # type: ignore[arg-type]
    "info not mapping": lambda: StepResult("x", 0.0, False, [1]),  # type: ignore[arg-type]
    "None": lambda: None,
    "short tuple": lambda: ("x", 0.0),
    "attribute raises": BadRepr,
}
WHY = {"nan reward": "reward nan is not a finite number", "inf reward": "reward inf is not a finite number",
       "text reward": "reward '1' is not a finite number", "observation not text": "observation is list, not text",
       "done not bool": "done is str 'yes', not a bool", "info not mapping": "info is list, not a mapping",
       "None": "step returned NoneType", "short tuple": "step returned tuple",
       "attribute raises": "the step's result could not be read: RuntimeError: boom"}


def episode(behaviour: str, max_turns: int = 10) -> Episode:
    return Episode(lambda: Scripted(behaviour), EpisodeLimits(max_turns=max_turns, step_timeout_s=TIMEOUT_S))


@pytest.mark.parametrize(("behaviour", "end", "detail"), [
    ("raises", "error", "step raised ZeroDivisionError: division by zero"),
    ("exits", "error", "step raised SystemExit: 3"),
    *[(name, "invalid", WHY[name]) for name in GARBAGE],
])
def test_a_failing_step_ends_the_trajectory_with_its_reason(behaviour: str, end: str, detail: str) -> None:
    ep = episode(behaviour)
    assert ep.start({}, 0).observation == "go"
    first = ep.step("a")
    assert (first.observation, first.reward, first.done) == ("again", 0.5, False)
    last = ep.step("b")
    assert last.done and last.end == end and end in END_REASONS and last.info["detail"].startswith(detail), last
    assert ep.summary() == {"turns": 2, "end": end, "reward": 0.5, "env_seconds": ep.env_seconds, "tool_calls": {},
                            "detail": last.info["detail"]}
    with pytest.raises(RuntimeError, match="not running"):  # the rollout loop's bug, not the env's
        ep.step("c")


@pytest.mark.parametrize(("behaviour", "end", "detail"), [
    ("reset raises", "error", "building or resetting the env raised RuntimeError: no such task"),
    ("reset garbage", "invalid", "reset returned bytes, not text"),
    ("reset hangs", "timeout", f"building or resetting the env took over {TIMEOUT_S} s"),
])
def test_a_failing_start_ends_the_trajectory_before_its_first_turn(behaviour: str, end: str, detail: str) -> None:
    started = time.monotonic()
    step = episode(behaviour).start({}, 0)
    assert step.done and step.end == end and step.info["detail"] == detail
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S


def test_a_step_that_hangs_forever_is_abandoned_at_the_timeout_and_the_episode_beside_it_plays_on() -> None:
    hung, healthy = episode("hangs"), Episode(RunningSum, EpisodeLimits(max_turns=3, step_timeout_s=TIMEOUT_S))
    hung.start({}, 0)
    hung.step("a")
    assert healthy.start({"digits": [1, 2, 3]}, 0).observation == "1="
    before, started = abandoned_calls(), time.monotonic()
    step = hung.step("b")
    waited = time.monotonic() - started
    assert step.done and step.end == "timeout" and step.info["detail"] == f"the turn took over {TIMEOUT_S} s"
    assert TIMEOUT_S <= waited < TIMEOUT_S + SLACK_S, waited
    assert abandoned_calls() == before + 1
    hung.close()  # an abandoned env is not called again (its close would hang too)
    rewards = [healthy.step(a).reward for a in ("1", "3", "6")]
    assert rewards == pytest.approx([1 / 3] * 3) and healthy.end == "done"


def test_max_turns_ends_a_trajectory_that_never_finishes() -> None:
    class Endless:
        def reset(self, task: Mapping[str, Any], seed: int) -> str:
            return "0"

        def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
            return action, 1.0, False, {}  # a gym-style 4-tuple is accepted

    ep = Episode(Endless, EpisodeLimits(max_turns=3, step_timeout_s=TIMEOUT_S))
    ep.start({}, 0)
    steps = [ep.step(str(i)) for i in range(3)]
    assert [s.done for s in steps] == [False, False, True] and steps[-1].end == "max_turns"
    assert steps[-1].observation == "2" and steps[-1].info["detail"] == "3 actions, env.max_turns=3"
    assert ep.rewards == [1.0, 1.0, 1.0]  # the last turn's reward is kept


def test_an_envs_own_detail_on_done_reaches_the_summary() -> None:
    class Resigns:
        def reset(self, task: Mapping[str, Any], seed: int) -> str:
            return "0"

        def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
            return "", 0.0, True, {"detail": "the answer\n  was never given"}

    ep = Episode(Resigns, EpisodeLimits(max_turns=3, step_timeout_s=TIMEOUT_S))
    ep.start({}, 0)
    assert ep.step("1").end == "done"
    assert ep.summary()["detail"] == "the answer was never given"  # one line, as the controller logs it


def test_the_rollout_loop_ends_a_trajectory_over_its_context_budget() -> None:
    ep = Episode(RunningSum)
    ep.start({}, 0)
    ep.step("1")
    step = ep.stop("max_context", "70 tokens > env.max_context_tokens=64")
    assert step.done and step.end == "max_context" and ep.summary()["turns"] == 1
    assert ep.stop("timeout").end == "max_context"  # the first reason stays


def test_a_tool_that_hangs_ends_the_trajectory_at_the_timeout() -> None:
    def slow(key: str) -> str:
        FOREVER.wait()
        return key

    ep = Episode(RunningSum, EpisodeLimits(max_turns=3, step_timeout_s=TIMEOUT_S), tools={"slow": slow})
    ep.start({}, 0)
    started = time.monotonic()
    step = ep.step('<tool_call>{"name": "slow", "arguments": {"key": "k"}}</tool_call>')
    assert step.end == "timeout" and time.monotonic() - started < TIMEOUT_S + SLACK_S


def test_ctrl_c_in_the_caller_stops_the_caller_and_is_not_taken_for_the_envs_failure() -> None:
    ep = episode("hangs")
    ep.start({}, 0)
    ep.step("a")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job may ignore SIGINT
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            ep.step("b")  # the step hangs; the signal arrives while the caller waits for it
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
    assert ep.end is None
