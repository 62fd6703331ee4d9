"""From the config's ``env`` section to episodes: the env class and its arguments, the tools (built
once per host: the python tool's sandbox is shared by every episode), the limits and the tool-call
format.

    setup = EnvSetup(plain_cfg)                  # plain_cfg: rlbatch.config.plain.to_plain(cfg)
    episode = setup.episode()                    # one per trajectory
    first = episode.start(task, seed)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlbatch.envs.base import Tool
from rlbatch.envs.episode import Episode, EpisodeLimits
from rlbatch.envs.registry import resolve_env, resolve_tool
from rlbatch.envs.tools import ToolCallFormat


def tool_format(env_cfg: Mapping[str, Any]) -> ToolCallFormat:
    call = list(env_cfg.get("tool_call_tags") or ("<tool_call>", "</tool_call>"))
    response = list(env_cfg.get("tool_response_tags") or ("<tool_response>", "</tool_response>"))
    return ToolCallFormat(str(call[0]), str(call[1]), str(response[0]), str(response[1]),
                          env_cfg.get("tool_call_format") or "json")


class EnvSetup:
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        env_cfg = cfg.get("env") or {}
        if not env_cfg.get("name"):
            raise ValueError("env.name is not set: this run has no environment (single-turn rollouts)")
        cls = resolve_env(env_cfg["name"])
        assert cls is not None
        self.cls, self.args = cls, dict(env_cfg.get("args") or {})
        self.tools: dict[str, Tool] = {}
        for name in env_cfg.get("tools") or []:
            factory = resolve_tool(name)
            assert factory is not None
            self.tools[name] = factory(cfg)
        self.limits = EpisodeLimits(int(env_cfg.get("max_turns", 8)), float(env_cfg.get("step_timeout_s", 30.0)))
        self.format = tool_format(env_cfg)

    def episode(self) -> Episode:
        return Episode(lambda: self.cls(**self.args), self.limits, self.tools, self.format)
