"""Tool calls inside an action: the one format rlbatch parses, and running a call to text.

The format is Qwen2.5's (its chat template asks the model for it, and Hermes-style function
calling uses the same): a JSON object with the tool's ``name`` and its ``arguments`` between a tag
pair, several per action allowed::

    <tool_call>
    {"name": "lookup", "arguments": {"key": "k3"}}
    </tool_call>

``arguments`` may also be a JSON string holding that object (OpenAI's encoding); absent, it is
``{}``. Each call's output comes back wrapped in the response tags (Qwen's ``<tool_response>``).
Both tag pairs are configurable (``env.tool_call_tags``, ``env.tool_response_tags``). A call that
cannot be read, names no tool of the episode, does not fit the tool's parameters or fails
becomes an observation saying so, counted by its outcome (``base.TOOL_OUTCOMES``); nothing here
raises out to the caller.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlbatch.envs.base import Tool, ToolError, ToolOutcome


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Malformed:
    why: str


@dataclass(frozen=True)
class ToolCallFormat:
    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    response_open: str = "<tool_response>"
    response_close: str = "</tool_response>"

    def parse(self, action: str) -> list[ToolCall | Malformed]:
        """Every call in ``action``, in order; [] when it holds none (a plain answer)."""
        out: list[ToolCall | Malformed] = []
        at = action.find(self.call_open)
        while at >= 0:
            start = at + len(self.call_open)
            end = action.find(self.call_close, start)
            if end < 0:
                out.append(Malformed(f"{self.call_open} without {self.call_close}"))
                break
            out.append(_read_call(action[start:end]))
            at = action.find(self.call_open, end + len(self.call_close))
        return out

    def response(self, text: str) -> str:
        return f"{self.response_open}\n{text}\n{self.response_close}"


def _read_call(body: str) -> ToolCall | Malformed:
    try:
        call = json.loads(body)
    except ValueError as e:
        return Malformed(f"not JSON ({e})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return Malformed('expected a JSON object {"name": ..., "arguments": {...}}')
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            return Malformed(f"arguments: not JSON ({e})")
    if not isinstance(args, dict):
        return Malformed(f"arguments: expected a JSON object, got {type(args).__name__}")
    return ToolCall(call["name"], args)


def run_call(call: ToolCall | Malformed, tools: Mapping[str, Tool]) -> tuple[str, ToolOutcome]:
    """The text a call returns and its outcome. Called under the episode's step timeout."""
    if isinstance(call, Malformed):
        return f"error: malformed tool call: {call.why}"[:500], "malformed"
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}"[:200] + f"; tools: {sorted(tools)}", "unknown_tool"
    try:
        inspect.signature(tool).bind(**call.arguments)
    except TypeError as e:
        return f"error: tool {call.name!r}: {e}"[:500], "bad_arguments"
    except ValueError:  # a builtin without a signature: judged by the call itself
        pass
    try:
        out = tool(**call.arguments)
    except ToolError as e:
        return f"error: {e}", "tool_error"
    except Exception as e:  # the tool's failure is the policy's observation, not the job's
        return f"error: tool {call.name!r} raised {type(e).__name__}: {e}"[:1000], "tool_error"
    if not isinstance(out, str):
        return f"error: tool {call.name!r} returned {type(out).__name__}, not text", "tool_error"
    return out, "ok"
