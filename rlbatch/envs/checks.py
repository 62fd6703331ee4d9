"""The config's ``env`` section checked before anything starts: each problem names the field and
the value. Field types and ranges are ``rlbatch.config.bounds``'s; this adds what ties them to
names, code and other sections. Called by ``rlbatch.checks.validate.check``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

from rlbatch.config.plain import section
from rlbatch.envs.registry import UnknownName, resolve_env, resolve_tool
from rlbatch.envs.tools import SYNTAXES


def _tag_problem(key: str, tags: Any) -> str | None:
    if tags is None:
        return None
    if (not isinstance(tags, (list, tuple)) or len(tags) != 2
            or not all(isinstance(t, str) and t.strip() and len(t) <= 64 for t in tags)):
        return f"env.{key}: expected [open, close], two non-blank strings of at most 64 characters, got {tags!r}"[:300]
    return None


def _observation_role_problems(cfg: Mapping[str, Any], role: Any) -> list[str]:
    if not (isinstance(role, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,31}", role)):
        return [f"env.observation_role: expected a message role such as 'user' or 'tool' (a name of at most 32 "
                f"letters, digits, '_' or '-'), got {role!r}"[:200]]
    if role != "user" and not section(cfg, "data").get("chat_template"):
        return [f"env.observation_role: {role!r}, but data.chat_template=false: observations are then plain text, "
                f"not messages; set data.chat_template=true or leave it 'user'"]
    return []


def env_problems(cfg: Mapping[str, Any], load: bool = True) -> list[str]:
    """Problems of ``cfg['env']``. ``load``: also import a plugin env's module and check ``env.args``
    against its constructor (False: names and forms only, as the planner validates)."""
    env = cfg.get("env")
    if env is None:
        return []
    if not isinstance(env, Mapping):
        return [f"env: expected a mapping of environment settings, got {type(env).__name__} {env!r}"[:200]]
    problems = [p for key in ("tool_call_tags", "tool_response_tags") if (p := _tag_problem(key, env.get(key)))]
    if env.get("tool_call_format", "json") not in SYNTAXES:
        problems.append(f"env.tool_call_format: expected one of {list(SYNTAXES)}, got {env['tool_call_format']!r}"[:200])
    problems += _observation_role_problems(cfg, env.get("observation_role", "user"))
    args, tools, name = env.get("args"), env.get("tools"), env.get("name")
    if args is not None and not (isinstance(args, Mapping) and all(isinstance(k, str) for k in args)):
        problems.append(f"env.args: expected a mapping of keyword arguments, got {args!r}"[:200])
        args = None
    if tools is not None and not isinstance(tools, (list, tuple)):
        problems.append(f"env.tools: expected a list of tool names, got {type(tools).__name__} {tools!r}"[:200])
        tools = None
    if name is None:
        if tools:
            problems.append(f"env.tools: {list(tools)!r} are called inside an environment's episodes, and env.name "
                            f"is not set"[:300])
        return problems
    cls = None
    try:
        cls = resolve_env(name, load=load)
    except UnknownName as e:
        problems.append(f"env.name: {e}")
    for tool in tools or []:
        try:
            resolve_tool(tool, load=load)
        except UnknownName as e:
            problems.append(f"env.tools: {e}")
    if cls is not None and args:
        try:
            inspect.signature(cls).bind(**args)
        except TypeError as e:
            problems.append(f"env.args: {sorted(args)} do not fit {cls.__name__}{_signature(cls)}: {e}"[:400])
    problems.extend(_limit_problems(cfg, env, tools or []))
    return problems


def _signature(cls: type) -> str:
    try:
        return str(inspect.signature(cls).replace(return_annotation=inspect.Signature.empty))
    except (TypeError, ValueError):
        return "(...)"


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _limit_problems(cfg: Mapping[str, Any], env: Mapping[str, Any], tools: Any) -> list[str]:
    """Limits that are each in range but cannot work together."""
    problems = []
    model = section(cfg, "model")
    budget, positions = _number(env.get("max_context_tokens")), _number(model.get("max_position_embeddings"))
    if budget is not None and positions is not None and not model.get("path") and budget > positions:
        problems.append(f"env.max_context_tokens: {env['max_context_tokens']} tokens is longer than the random-init "
                        f"model's longest sequence, model.max_position_embeddings = {model['max_position_embeddings']}")
    limits = section(cfg, "sandbox", "limits")
    step, run = _number(env.get("step_timeout_s")), _number(limits.get("timeout_s"))
    if "python" in tools and step is not None and run is not None and step <= run:
        problems.append(f"env.step_timeout_s: {env['step_timeout_s']} s is not longer than sandbox.limits.timeout_s = "
                        f"{limits['timeout_s']} s, which one python tool call may take; the sandbox would not get to "
                        f"kill a runaway execution and report it before the step is abandoned")
    return problems
