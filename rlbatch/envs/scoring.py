"""The reward of a trajectory, as the reward role scores it in a run with an environment.

The env's rewards (summed over the trajectory's turns) come back from the generate phase with the
trajectory's summary, and the controller sends them to the score phase beside the answers
(``env_rewards``); ``env.reward_fn_weight`` > 0 adds that weight times ``data.reward_fn`` of the
whole response (turns and observations, decoded) and the data set's answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rlbatch.rewards.rules import reward_value, rule_scorer

if TYPE_CHECKING:
    from rlbatch.config.schema import RLBatchConfig


def env_scorer(cfg: RLBatchConfig) -> Callable[..., tuple[list[float], dict[str, int]]]:
    weight = float(getattr(cfg.env, "reward_fn_weight", 0.0) or 0.0)
    rule = rule_scorer(cfg) if weight else None

    def score(completions: list[str], answers: list[str], sources: list[str] | None = None,
              env_rewards: list[float] | None = None) -> tuple[list[float], dict[str, int]]:
        if env_rewards is None or len(env_rewards) != len(completions):
            raise ValueError(f"env.name={cfg.env.name!r}: the score phase got {len(env_rewards or [])} trajectory "
                             f"rewards for {len(completions)} responses (single-turn samples in a run with an env?)")
        total = []
        for i, r in enumerate(env_rewards):
            value = reward_value(r)
            if value is None:  # the episode guard checks every step's reward: this is a bug, not bad env output
                raise ValueError(f"trajectory {i}: its env reward {r!r} is not a finite number")
            total.append(value)
        counts: dict[str, int] = {}
        if rule is not None:
            extra, counts = rule(completions, answers, sources)
            total = [t + weight * x for t, x in zip(total, extra, strict=True)]
        return total, counts

    return score
