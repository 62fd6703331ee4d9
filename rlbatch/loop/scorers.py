"""Which scorer each CPU role that works in a ``score`` phase of the phase table runs, on its rank:
the reward role's rule (``data.reward_fn``) or, in a run with an environment, each trajectory's env
reward; the code_sandbox role's hidden tests. A scorer is ``rlbatch.rewards.Scorer``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from rlbatch.config.schema import RLBatchConfig
from rlbatch.rewards import Scorer

SCORERS: dict[str, str] = {
    "reward": "rlbatch.loop.scorers:reward_role_scorer",
    "code_sandbox": "rlbatch.rewards.code:code_scorer",
}
"""CPU role -> ``module:factory``; ``factory(cfg) -> Scorer``."""


def reward_role_scorer(cfg: RLBatchConfig) -> Scorer:
    """The reward role's scorer: ``data.reward_fn`` (``rules.rule_scorer``); in a run with an
    environment (``env.name``), each trajectory's env reward (``rlbatch.envs.scoring``)."""
    if getattr(getattr(cfg, "env", None), "name", None):
        from rlbatch.envs.scoring import env_scorer

        return env_scorer(cfg)
    from rlbatch.rewards.rules import rule_scorer

    return rule_scorer(cfg)


def build_scorer(role: str, cfg: RLBatchConfig) -> Scorer:
    if role not in SCORERS:
        raise KeyError(f"role {role!r} scores responses but no scorer is registered for it; scorers: {sorted(SCORERS)}")
    module, _, name = SCORERS[role].partition(":")
    factory: Callable[[RLBatchConfig], Scorer] = getattr(importlib.import_module(module), name)
    return factory(cfg)
