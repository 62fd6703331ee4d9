"""Tool calls inside an action: the formats rlbatch parses, and running a call to text.

``json`` (the default) is Qwen2.5's format (its chat template asks the model for it, and
Hermes-style function calling uses the same): a JSON object with the tool's ``name`` and its
``arguments`` between a tag pair, several per action allowed::

    <tool_call>
    {"name": "lookup", "arguments": {"key": "k3"}}
    </tool_call>

``arguments`` may also be a JSON string holding that object (OpenAI's encoding); absent, it is
``{}``. Each call's output comes back wrapped in the response tags (Qwen's ``<tool_response>``).

``compact`` is for a model that cannot write JSON (a character tokenizer with a small alphabet):
between the tags, ``name(arg, key=value)``, or the bare arguments ``arg, key=value`` for the
episode's only tool; every argument is text. With tags ``["@", ";"]``, ``@lookup(k3);`` and
``@k3`` are the same call. A call ends at its close tag or at the end of the action (the text
before its stop marker), so one that runs to the end needs no close tag; its output comes back
as ``open + output + close``, without the newlines ``json`` puts around it.

Both tag pairs are configurable (``env.tool_call_tags``, ``env.tool_response_tags``), the format
too (``env.tool_call_format``). A call that cannot be read, names no tool of the episode, does
not fit the tool's parameters or fails becomes an observation saying so, counted by its outcome
(``base.TOOL_OUTCOMES``), whichever the format; nothing here raises out to the caller.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from rlbatch.data.records import JsonValue
from rlbatch.envs.base import Tool, ToolError, ToolOutcome
from rlbatch.rewards.rules import split_at_stop

Syntax = Literal["json", "compact"]
SYNTAXES: tuple[Syntax, ...] = ("json", "compact")


@dataclass(frozen=True)
class ToolCall:
    name: str
    """The tool's name; '' (the compact format's bare arguments): the episode's only tool."""
    arguments: dict[str, JsonValue]
    positional: tuple[str, ...] = ()
    """Arguments by position, before ``arguments`` (the compact format's ``name(a, b)``)."""


@dataclass(frozen=True)
class Malformed:
    why: str


@dataclass(frozen=True)
class ToolCallFormat:
    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    response_open: str = "<tool_response>"
    response_close: str = "</tool_response>"
    syntax: Syntax = "json"
    """What is between the call tags: ``json`` or ``compact`` (the module's docstring)."""

    def __post_init__(self) -> None:
        if self.syntax not in SYNTAXES:
            raise ValueError(f"tool call format must be one of {list(SYNTAXES)}, got {self.syntax!r}")

    def parse(self, action: str) -> list[ToolCall | Malformed]:
        """Every call in ``action``, in order; [] when it holds none (a plain answer)."""
        compact = self.syntax == "compact"
        if compact:  # what follows the stop marker was never the policy's action
            action = split_at_stop(action)[0]
        out: list[ToolCall | Malformed] = []
        at = action.find(self.call_open)
        while at >= 0:
            start = at + len(self.call_open)
            end = action.find(self.call_close, start)
            if end < 0 and not compact:
                out.append(Malformed(f"{self.call_open} without {self.call_close}"))
                break
            body = action[start:end] if end >= 0 else action[start:]
            out.append(_read_compact(body) if compact else _read_call(body))
            if end < 0:
                break
            at = action.find(self.call_open, end + len(self.call_close))
        return out

    def response(self, text: str) -> str:
        if self.syntax == "compact":
            return f"{self.response_open}{text}{self.response_close}"
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


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAMED = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)\((.*)\)\s*", re.S)
_OPENS_NAMED = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_.-]*\(")


def _read_compact(body: str) -> ToolCall | Malformed:
    """``name(a, k=v)`` or the bare ``a, k=v`` (name ''); arguments are text, split at commas."""
    named = _NAMED.fullmatch(body)
    if named:
        name, inner = named.group(1), named.group(2)
    elif _OPENS_NAMED.match(body):
        return Malformed(f"expected name(arguments), got {body.strip()!r}"[:200])
    else:
        name, inner = "", body
    positional: list[str] = []
    keywords: dict[str, JsonValue] = {}
    for item in inner.split(",") if inner.strip() else []:
        key, eq, value = item.partition("=")
        if eq and _IDENT.fullmatch(key.strip()):
            if key.strip() in keywords:
                return Malformed(f"argument {key.strip()!r} given twice")
            keywords[key.strip()] = value.strip()
        elif not item.strip():
            return Malformed(f"an empty argument in {inner.strip()!r}"[:200])
        elif keywords:
            return Malformed(f"positional argument {item.strip()!r} after a keyword argument"[:200])
        else:
            positional.append(item.strip())
    return ToolCall(name, keywords, tuple(positional))


def run_call(call: ToolCall | Malformed, tools: Mapping[str, Tool]) -> tuple[str, ToolOutcome]:
    """The text a call returns and its outcome. Called under the episode's step timeout."""
    if isinstance(call, Malformed):
        return f"error: malformed tool call: {call.why}"[:500], "malformed"
    name = call.name
    if not name:  # the compact format's bare arguments: only one tool can be meant
        if len(tools) != 1:
            return f"error: a call without a tool name needs exactly one tool; tools: {sorted(tools)}"[:300], \
                "unknown_tool"
        name = next(iter(tools))
    tool = tools.get(name)
    if tool is None:
        return f"error: unknown tool {name!r}"[:200] + f"; tools: {sorted(tools)}", "unknown_tool"
    try:
        inspect.signature(tool).bind(*call.positional, **call.arguments)
    except TypeError as e:
        return f"error: tool {name!r}: {e}"[:500], "bad_arguments"
    except ValueError:  # a builtin without a signature: judged by the call itself
        pass
    try:
        out = tool(*call.positional, **call.arguments)
    except ToolError as e:
        return f"error: {e}", "tool_error"
    except Exception as e:  # the tool's failure is the policy's observation, not the job's
        return f"error: tool {name!r} raised {type(e).__name__}: {e}"[:1000], "tool_error"
    if not isinstance(out, str):
        return f"error: tool {name!r} returned {type(out).__name__}, not text", "tool_error"
    return out, "ok"
