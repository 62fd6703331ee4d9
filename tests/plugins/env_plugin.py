"""A user environment in its own module, for the plugin tests: ``env.name=tests.plugins.env_plugin:Countdown``
names it by path; ``plugins=[tests.plugins.env_plugin]`` with ``env.name=countdown`` uses the name
it registers on import. ``NoStep`` is a class that is not an environment (no ``step``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlbatch.envs.base import StepResult
from rlbatch.envs.registry import register_env


@register_env("countdown")
class Countdown:
    """Shows n; the policy answers n-1, n-2, ... down to 0 (reward 1 per right answer)."""

    def __init__(self, start: int = 3) -> None:
        self.start = start
        self.n = start

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        self.n = int(task.get("start", self.start))
        return str(self.n)

    def step(self, action: str) -> StepResult:
        self.n -= 1
        right = action.strip() == str(self.n)
        return StepResult(str(self.n), 1.0 if right else 0.0, self.n == 0)


class NoStep:
    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        return ""
