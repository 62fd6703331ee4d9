"""The environment contract: what an env implements, what one step returns, and the fixed sets of
names (trajectory end reasons, tool-call outcomes) that metrics count.

An environment is any class with these two methods (no base class to inherit)::

    class MyEnv:
        def reset(self, task: Task, seed: int) -> str: ...   # the first observation
        def step(self, action: str) -> StepResult: ...                   # the policy's text in

and, optionally, ``tools`` (a mapping of tool name -> callable, read after ``reset``: tools bound
to the episode, such as ``lookup``'s table) and ``close()``. The class is constructed with the
keyword arguments of ``env.args``, once per episode. ``rlbatch.envs.episode.Episode`` calls it:
one call at a time, each under the step timeout, each result checked; whatever the env does
(raise, hang, return garbage) ends its trajectory with a reason, never the process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

EndReason = Literal["done", "max_turns", "max_context", "timeout", "error", "invalid"]
END_REASONS: tuple[EndReason, ...] = ("done", "max_turns", "max_context", "timeout", "error", "invalid")
"""Why a trajectory ended: the env said ``done``; the policy used ``env.max_turns`` actions; the
trajectory outgrew ``env.max_context_tokens`` (the rollout loop counts tokens and ends it); a call
into the env or a tool outlived ``env.step_timeout_s``; the env raised; the env returned what the
contract does not allow (a non-text observation, a reward that is not a finite number, ...)."""

ToolOutcome = Literal["ok", "malformed", "unknown_tool", "bad_arguments", "tool_error"]
TOOL_OUTCOMES: tuple[ToolOutcome, ...] = ("ok", "malformed", "unknown_tool", "bad_arguments", "tool_error")
"""What became of one tool call: it ran; its text was not a well-formed call; it named no tool
the episode has; its arguments do not fit the tool's parameters; the tool raised (a ``ToolError``
is the tool's own way to say the call failed, e.g. the python tool's code raised)."""

Task = Mapping[str, object]
"""A task record an episode starts from: a data set row's fields (``answer``, ``data_source``, an
env's own such as ``lookup``'s ``table``), which an env checks as it reads them; may be empty."""

Tool = Callable[..., str]
"""A tool: called with the call's arguments as keyword arguments, returns the text the policy reads."""


@dataclass
class StepResult:
    """What ``Env.step`` returns. A 4-tuple ``(observation, reward, done, info)`` is accepted too."""

    observation: str
    """Text appended to the trajectory before the policy's next turn ('' when done)."""
    reward: float = 0.0
    """This step's reward (a finite number); the trajectory's rewards are kept per turn."""
    done: bool = False
    """The episode is over (the policy won, lost or finished)."""
    info: dict[str, object] = field(default_factory=dict)
    """Anything the env wants to report (kept with the step; not read by rlbatch)."""


@runtime_checkable
class Env(Protocol):
    def reset(self, task: Task, seed: int) -> str:
        """Start an episode from a task record (a data set row; may be empty) and a seed: the same
        task and seed give the same episode. Returns the first observation."""
        ...

    def step(self, action: str) -> StepResult:
        """The policy's action (its decoded text for this turn, stop marker included when it
        stopped) -> the next observation, the reward, done, info."""
        ...


class ToolError(Exception):
    """Raised by a tool to say the call failed; the message (not a traceback) is what the policy
    reads, and the call counts as ``tool_error``."""
