"""One trajectory's episode, guarded: the env and its tools are called one at a time, each call
under ``step_timeout_s``, each result checked; whatever goes wrong ends this trajectory with a
reason from ``base.END_REASONS`` (a metric), never the process.

    episode = Episode(RunningSum, EpisodeLimits(max_turns=3, step_timeout_s=5.0))
    first = episode.start(task={}, seed=7)        # Step(observation='5=', done=False, ...)
    step = episode.step("5<eos>")                 # Step(observation='+2=', reward=0.333..., ...)
    step.done, step.end                           # (True, 'timeout') once a call hangs

An action that holds tool calls (``tools.ToolCallFormat``) is a tool step: the calls run in
order and their outputs, in the response tags, are the observation (reward 0); any other action
goes to ``env.step``. Both count as a turn.

Why a thread per call, abandoned on timeout: a Python thread cannot be killed, but it need not be
waited for. A call that outlives the timeout is left to finish (or not) on its daemon thread; its
episode ends with ``timeout`` and never calls that env again, so nothing waits on it and nothing
it returns later is read (``abandoned_calls()`` counts them for the worker's metrics). A process
per env worker (the ``env`` role) is the boundary for what a thread cannot contain (a C call that
holds the GIL, memory blow-up, ``os._exit``): the job sees that worker die and names it. A process
per episode would also contain those, at a fork and a round trip of pickled state per step, and
would require every env to pickle; untrusted code, the one case that needs a kill, already runs
in the sandbox's own killed-on-timeout processes (the ``python`` tool).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, TypeVar

from rlbatch.envs.base import EndReason, Env, Task, Tool, ToolOutcome
from rlbatch.envs.tools import ToolCallFormat, run_call
from rlbatch.rewards.rules import reward_value

T = TypeVar("T")

_abandoned = 0
_abandoned_lock = threading.Lock()


def abandoned_calls() -> int:
    """Calls into envs or tools this process stopped waiting for (their threads may still run)."""
    return _abandoned


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    """Actions per trajectory; the one that reaches it ends the trajectory (``max_turns``)."""
    step_timeout_s: float = 30.0
    """Longest one call into the env (construction with reset, a step, a turn's tool calls)."""


@dataclass
class Step:
    """What the rollout loop gets back for a start or an action."""

    observation: str
    """Text to append before the policy's next turn."""
    reward: float = 0.0
    done: bool = False
    """The trajectory is over (any reason: ``end``)."""
    end: EndReason | None = None
    """Why it ended (``base.END_REASONS``) when done, else None."""
    info: dict[str, object] = field(default_factory=dict)
    """The env's info; ``tool_calls`` (outcomes of this turn's calls), ``detail`` (what went wrong)."""


class EpisodeSummary(TypedDict, total=False):
    """What metrics count for one trajectory (``Episode.summary``); an env worker's adds ``worker``,
    and a remote episode closed before it ended has none of it."""

    turns: int
    end: EndReason | None
    reward: float
    env_seconds: float
    tool_calls: dict[str, int]
    detail: str
    """What ended it, in words (the env's error, the call that timed out); '' when it ended well."""
    worker: int


class EpisodeHandle(Protocol):
    """What the rollout loop drives: an ``Episode`` on this rank, or a ``client.RemoteEpisode``."""

    def start(self, task: Task, seed: int) -> Step: ...
    def step(self, action: str) -> Step: ...
    def stop(self, reason: EndReason, detail: str = "") -> Step: ...
    def summary(self) -> EpisodeSummary: ...
    def close(self) -> None: ...


Checked = tuple[str, float, bool, dict[str, object]]
"""A step's result that keeps the contract: (observation, reward, done, info)."""


class _Abandoned(Exception):
    pass


class _Raised(Exception):
    """What the env's call raised, carried out of its thread: only that is the env's failure (a
    Ctrl-C in the caller's own thread still stops the caller)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def _call(fn: Callable[..., T], *args: object, timeout: float) -> T:
    """``fn(*args)`` on a daemon thread: its result; _Raised carrying what it raised; _Abandoned past ``timeout``."""
    value: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            value.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 (SystemExit from an env is its failure too)
            error.append(e)

    thread = threading.Thread(target=run, name="rlbatch-env-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        global _abandoned
        with _abandoned_lock:
            _abandoned += 1
        raise _Abandoned()
    if error:
        raise _Raised(error[0])
    return value[0]


def build_problem(make_env: Callable[[], object], timeout: float) -> str | None:
    """Build one env as an episode does (under ``timeout``) and close it again: None, or what went
    wrong in words. Validation's check that ``env.args`` are values the env's constructor takes."""
    try:
        env = _call(make_env, timeout=timeout)
    except _Abandoned:
        return f"building it took over {timeout} s"
    except _Raised as e:
        return f"building it raised {_said(e.error)}"
    close = getattr(env, "close", None)
    if callable(close):
        with contextlib.suppress(_Abandoned, _Raised):
            _call(close, timeout=timeout)
    return None


def _said(e: BaseException) -> str:
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001 (its __str__ failed: the type still says what happened)
        return type(e).__name__


def _checked(result: object) -> Checked | str:
    """A step's result as (observation, reward, done, info), or why it breaks the contract."""
    if hasattr(result, "observation") and hasattr(result, "reward") and hasattr(result, "done"):
        obs, reward, done, info = result.observation, result.reward, result.done, getattr(result, "info", None)
    elif isinstance(result, tuple) and len(result) == 4:
        obs, reward, done, info = result
    else:
        return f"step returned {type(result).__name__}, not a StepResult or (observation, reward, done, info)"
    if not isinstance(obs, str):
        return f"observation is {type(obs).__name__}, not text"
    value = reward_value(reward)
    if value is None:
        return f"reward {reward!r} is not a finite number"[:200]
    if type(done).__name__ not in ("bool", "bool_"):  # numpy's bool as well
        return f"done is {type(done).__name__} {done!r}, not a bool"[:200]
    if info is not None and not isinstance(info, Mapping):
        return f"info is {type(info).__name__}, not a mapping"
    return obs, value, bool(done), dict(info or {})


class Episode:
    """One trajectory's env, tools and limits. Not thread-safe: one caller drives it."""

    def __init__(self, make_env: Callable[[], Env], limits: EpisodeLimits | None = None,
                 tools: Mapping[str, Tool] | None = None, fmt: ToolCallFormat | None = None) -> None:
        self.make_env, self.limits, self.fmt = make_env, limits or EpisodeLimits(), fmt or ToolCallFormat()
        self.shared_tools = dict(tools or {})
        self.env: Env | None = None
        self.turns = 0
        self.rewards: list[float] = []
        """Each action's reward, in order (tool steps: 0)."""
        self.tool_outcomes: Counter[str] = Counter()
        self.env_seconds = 0.0
        """Time spent in calls into the env and its tools."""
        self.end: EndReason | None = None
        self.detail = ""

    def start(self, task: Task, seed: int) -> Step:
        """Build the env and reset it; the first observation, or a trajectory already ended."""
        if self.env is not None or self.end is not None:
            raise RuntimeError("Episode.start: this episode has already started")

        def build() -> tuple[Env, str]:
            env = self.make_env()
            return env, env.reset(task, seed)

        try:
            self.env, obs = self._timed(build)
        except _Abandoned:
            return self._ended("timeout", f"building or resetting the env took over {self.limits.step_timeout_s} s")
        except _Raised as e:
            return self._ended("error", f"building or resetting the env raised {_said(e.error)}")
        if not isinstance(obs, str):
            return self._ended("invalid", f"reset returned {type(obs).__name__}, not text")
        return Step(obs)

    def step(self, action: str) -> Step:
        """The policy's action -> the next observation; ``done`` when the trajectory ended."""
        if self.end is not None or self.env is None:
            raise RuntimeError(f"Episode.step: the episode is not running (ended: {self.end})")
        self.turns += 1

        def turn() -> list[tuple[str, ToolOutcome]] | Checked | str:  # one timed call: the env's tools property is its code too
            env = self.env
            assert env is not None
            tools = self._tools()
            calls = self.fmt.parse(action) if tools else []
            if calls:  # the outputs and outcomes of the calls
                return [run_call(c, tools) for c in calls]
            result = env.step(action)
            try:  # inside the timed call: reading a user object's attributes runs its code
                return _checked(result)
            except Exception as e:  # noqa: BLE001
                return f"the step's result could not be read: {_said(e)}"

        try:
            result = self._timed(turn)
        except _Abandoned:
            return self._ended("timeout", f"the turn took over {self.limits.step_timeout_s} s")
        except _Raised as e:
            return self._ended("error", f"step raised {_said(e.error)}")
        if isinstance(result, list):  # a tool step
            outcomes: list[ToolOutcome] = [outcome for _, outcome in result]
            self.tool_outcomes.update(outcomes)
            obs = "".join(self.fmt.response(text) for text, _ in result)
            return self._after(obs, 0.0, False, {"tool_calls": outcomes})
        if isinstance(result, str):
            return self._ended("invalid", result)
        return self._after(*result)

    def stop(self, reason: EndReason, detail: str = "") -> Step:
        """End the trajectory from outside (the rollout loop: ``max_context`` when it outgrows
        the context budget)."""
        if self.end is None:
            return self._ended(reason, detail)
        return Step("", 0.0, True, self.end, {"detail": self.detail})

    def close(self) -> None:
        """Let the env free what it holds (its ``close()``, if any, under the timeout); an env
        abandoned on a timeout is not called again."""
        env, self.env = self.env, None
        close = getattr(env, "close", None)
        if env is None or self.end == "timeout" or not callable(close):
            return
        try:
            self._timed(close)
        except (_Raised, _Abandoned):  # closing is best effort; the trajectory is already scored
            pass

    def summary(self) -> EpisodeSummary:
        """What metrics count for this trajectory."""
        return {"turns": self.turns, "end": self.end, "reward": sum(self.rewards), "env_seconds": self.env_seconds,
                "tool_calls": dict(self.tool_outcomes), "detail": self.detail}

    def _tools(self) -> dict[str, Tool]:
        own = getattr(self.env, "tools", None)
        return {**self.shared_tools, **(dict(own) if isinstance(own, Mapping) else {})}

    def _timed(self, fn: Callable[..., T], *args: object) -> T:
        start = time.perf_counter()
        try:
            return _call(fn, *args, timeout=self.limits.step_timeout_s)
        finally:
            self.env_seconds += time.perf_counter() - start

    def _after(self, obs: str, reward: float, done: bool, info: dict[str, object]) -> Step:
        self.rewards.append(reward)
        if done:
            self.end = "done"
            if info.get("detail"):  # the env's own words on how it ended (docs/agents.md)
                self.detail = " ".join(str(info["detail"]).split())[:500]
        elif self.turns >= self.limits.max_turns:
            self.end, self.detail = "max_turns", f"{self.turns} actions, env.max_turns={self.limits.max_turns}"
            info = {**info, "detail": self.detail}
        return Step(obs, reward, self.end is not None, self.end, info)

    def _ended(self, reason: EndReason, detail: str) -> Step:
        self.end, self.detail = reason, " ".join(detail.split())[:500]
        if self.turns > len(self.rewards):
            self.rewards.append(0.0)
        return Step("", 0.0, True, reason, {"detail": self.detail})
