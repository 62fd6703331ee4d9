"""The config's ``env`` section checked before anything starts: each problem names the field and
the value. Field types and ranges are ``rlbatch.config.bounds``'s; this adds what ties them to
names, code and other sections, on the typed config. Called by ``rlbatch.checks.validate.check``.
"""

from __future__ import annotations

import functools
import inspect
import re

from rlbatch.config.parse import ROLE_WORDS
from rlbatch.config.schema import RLBatchConfig
from rlbatch.envs.episode import build_problem
from rlbatch.envs.registry import UnknownName, resolve_env, resolve_tool
from rlbatch.envs.tools import SYNTAXES


def _observation_role_problems(cfg: RLBatchConfig) -> list[str]:
    role = cfg.env.observation_role
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,31}", role):
        return [ROLE_WORDS.format(role)[:200]]
    if role != "user" and not cfg.data.chat_template:
        return [f"env.observation_role: {role!r}, but data.chat_template=false: observations are then plain text, "
                f"not messages; set data.chat_template=true or leave it 'user'"]
    return []


def env_problems(cfg: RLBatchConfig, load: bool = True) -> list[str]:
    """Problems of the ``env`` section (its types and shapes: the parse's). ``load``: also import a
    plugin env's module and check ``env.args`` against its constructor (False: names and forms only,
    as the planner validates)."""
    env = cfg.env
    problems = []
    if env.tool_call_format not in SYNTAXES:
        problems.append(f"env.tool_call_format: expected one of {list(SYNTAXES)}, got {env.tool_call_format!r}"[:200])
    problems += _observation_role_problems(cfg)
    if env.name is None:
        if env.tools:
            problems.append(f"env.tools: {list(env.tools)!r} are called inside an environment's episodes, and env.name "
                            f"is not set"[:300])
        return problems
    cls = None
    try:
        cls = resolve_env(env.name, load=load)
    except UnknownName as e:
        problems.append(f"env.name: {e}")
    for tool in env.tools:
        try:
            resolve_tool(tool, load=load)
        except UnknownName as e:
            problems.append(f"env.tools: {e}")
    if cls is not None:
        try:
            inspect.signature(cls).bind(**env.args)
        except TypeError as e:
            problems.append(f"env.args: {sorted(env.args)} do not fit {cls.__name__}{_signature(cls)}: {e}"[:400])
        else:  # the values too: built once here as each episode builds it (a refused value would end every episode)
            if load and (why := build_problem(functools.partial(cls, **env.args), env.step_timeout_s)) is not None:
                problems.append(f"env.args: {dict(env.args)!r} refused by {cls.__name__}{_signature(cls)}: {why}"[:400])
    problems.extend(_limit_problems(cfg))
    return problems


def _signature(cls: type) -> str:
    try:
        return str(inspect.signature(cls).replace(return_annotation=inspect.Signature.empty))
    except (TypeError, ValueError):
        return "(...)"


def _limit_problems(cfg: RLBatchConfig) -> list[str]:
    """Limits that are each in range but cannot work together."""
    problems = []
    env, model, limits = cfg.env, cfg.model, cfg.sandbox.limits
    budget, positions = env.max_context_tokens, model.max_position_embeddings
    if budget is not None and not model.path and budget > positions:
        problems.append(f"env.max_context_tokens: {budget} tokens is longer than the random-init "
                        f"model's longest sequence, model.max_position_embeddings = {positions}")
    if "python" in env.tools and env.step_timeout_s <= limits.timeout_s:
        problems.append(f"env.step_timeout_s: {env.step_timeout_s} s is not longer than sandbox.limits.timeout_s = "
                        f"{limits.timeout_s} s, which one python tool call may take; the sandbox would not get to "
                        f"kill a runaway execution and report it before the step is abandoned")
    return problems
