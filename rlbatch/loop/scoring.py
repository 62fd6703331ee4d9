"""The reward of a response: the weighted sum of what each scoring role gives it.

The reward role scores with ``data.reward_fn``; a ``code_sandbox`` role runs the response against
its tests. With no code_sandbox role the reward role's score is the reward (weight 1); with one,
``sandbox.code_weight`` and ``sandbox.rule_weight`` weigh the two (a weight of 0 skips its phase).
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

import torch

from rlbatch.config.schema import RLBatchConfig, SandboxConfig
from rlbatch.loop.controller import Pipeline, Role, Rollouts, Scores

if TYPE_CHECKING:
    from rlbatch.loop.samples import Shown


def weights(roles: Container[str], sandbox: SandboxConfig) -> dict[str, float]:
    """Scoring role -> weight, for the roles present (``roles``: names of the run's roles)."""
    if "code_sandbox" not in roles:
        return {"reward": 1.0}
    out = {"code_sandbox": float(sandbox.code_weight), "reward": float(sandbox.rule_weight)}
    return {r: w for r, w in out.items() if w != 0 and r in roles}


class Scoring:
    def __init__(self, pipe: Pipeline, cfg: RLBatchConfig) -> None:
        self.roles = [(Role(pipe, r), w) for r, w in weights(pipe.p.roles, cfg.sandbox).items()]
        self.pending: list[tuple[float, Scores]] = []
        self.show = 0
        """How many of each scored round's first samples the first scoring role sends back as text
        (set per step by the loop: ``rlbatch.loop.samples``); 0: none."""
        self.shown: dict[int, Shown] = {}
        """Those samples' text, gathered by ``result()`` (the loop empties it each step)."""

    def start(self, rollouts: Rollouts) -> None:
        """Start every scoring role at once (they run alongside the log-prob phases)."""
        self.pending = [(w, role.score(rollouts, rollouts.ids[: self.show] if k == 0 else ()))
                        for k, (role, w) in enumerate(self.roles)]

    def result(self) -> tuple[torch.Tensor, dict[str, int]]:
        """The rewards (in the rollouts' order) and the scorers' counts for the metrics."""
        total: torch.Tensor | None = None
        counts: dict[str, int] = {}
        for w, scores in self.pending:
            part = w * scores.result()
            total = part if total is None else total + part
            counts |= scores.counts
            self.shown |= scores.shown
        assert total is not None
        return total, counts
