"""From the config's ``env`` section to episodes: the env class and its arguments, the tools (built
once per host: the python tool's sandbox is shared by every episode), the limits and the tool-call
format.

    setup = EnvSetup(cfg)                        # cfg: the run's RLBatchConfig
    episode = setup.episode()                    # one per trajectory
    first = episode.start(task, seed)
"""

from __future__ import annotations

from typing import cast

from rlbatch.config.schema import EnvConfig, RLBatchConfig
from rlbatch.envs.base import Tool
from rlbatch.envs.episode import Episode, EpisodeLimits
from rlbatch.envs.registry import resolve_env, resolve_tool
from rlbatch.envs.tools import Syntax, ToolCallFormat


def tool_format(env: EnvConfig) -> ToolCallFormat:
    (call_open, call_close), (response_open, response_close) = env.tool_call_tags, env.tool_response_tags
    syntax = cast(Syntax, env.tool_call_format)  # ToolCallFormat refuses any other name
    return ToolCallFormat(call_open, call_close, response_open, response_close, syntax)


class EnvSetup:
    def __init__(self, cfg: RLBatchConfig) -> None:
        env = cfg.env
        if not env.name:
            raise ValueError("env.name is not set: this run has no environment (single-turn rollouts)")
        cls = resolve_env(env.name)
        assert cls is not None
        self.cls, self.args = cls, dict(env.args)
        self.tools: dict[str, Tool] = {}
        for name in env.tools:
            factory = resolve_tool(name)
            assert factory is not None
            self.tools[name] = factory(cfg)
        self.limits = EpisodeLimits(env.max_turns, env.step_timeout_s)
        self.format = tool_format(env)

    def episode(self) -> Episode:
        return Episode(lambda: self.cls(**self.args), self.limits, self.tools, self.format)
