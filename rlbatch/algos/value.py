"""PPO's critic side: GAE advantages from per-token values, the clipped value loss, explained variance.

Pure tensor functions plus ``ValueObjective``, the loss a critic's training engine minimises.
Per-token quantities are lists of 1-D tensors, one per response (possibly empty). For response
token t of a response of length T, ``V_t`` is the critic's value of the state that token t is
generated from (the same position whose logits score the token), and ``V_T = 0``: the episode
ends with the response.

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}        (A_T = 0)
    R_t     = A_t + V_t                              (the critic's regression target)

Value loss (PPO2, per token): ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``,
aggregated over response tokens like the policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlbatch.algos.advantages import TurnRewards, token_rewards, whiten_tokens
from rlbatch.algos.core import masked_mean
from rlbatch.algos.registry import AGGREGATIONS
from rlbatch.algos.split import loss_stat_factor, split_objective

if TYPE_CHECKING:
    from rlbatch.config.schema import AlgoConfig


def gae(rewards: list[Tensor], values: list[Tensor], gamma: float, lam: float) -> tuple[list[Tensor], list[Tensor]]:
    """Generalised advantage estimation within each response: (advantages, returns)."""
    if len(rewards) != len(values):
        raise ValueError(f"{len(rewards)} reward sequences but {len(values)} value sequences")
    advantages, returns = [], []
    for i, (r, v) in enumerate(zip(rewards, values, strict=True)):
        if r.numel() != v.numel():
            raise ValueError(f"sample {i}: {r.numel()} per-token rewards but {v.numel()} values")
        r, v = r.double(), v.double()
        adv = torch.zeros_like(r)
        running = torch.zeros((), dtype=torch.float64)
        for t in range(r.numel() - 1, -1, -1):
            next_v = v[t + 1] if t + 1 < v.numel() else torch.zeros((), dtype=torch.float64)
            running = r[t] + gamma * next_v - v[t] + gamma * lam * running
            adv[t] = running
        advantages.append(adv.float())
        returns.append((adv + v).float())
    return advantages, returns


def gae_estimator(rewards: Tensor, group_size: int, algo: AlgoConfig, *, lengths: list[int], kl: list[Tensor] | None = None,
                  values: list[Tensor] | None = None,
                  turn_rewards: TurnRewards | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """The ``gae`` advantage estimator (PPO): per-token rewards (the task reward on the last token,
    a trajectory's per-turn rewards at their turns, minus ``kl_coef * KL_t`` when ``kl`` is given),
    GAE over the critic's ``values``, advantages whitened over the batch's tokens when
    ``algo.whiten_advantages``. Returns (advantages, returns)."""
    if values is None:
        raise ValueError("the gae advantage estimator needs the critic's values (algo.name=ppo with a critic role)")
    per_token = token_rewards(rewards, lengths, kl, float(algo.kl_coef), turn_rewards)
    advantages, returns = gae(per_token, values, float(algo.gamma), float(algo.lam))
    if algo.whiten_advantages:
        advantages = whiten_tokens(advantages, float(algo.adv_eps))
    return advantages, returns


def explained_variance(values: list[Tensor], returns: list[Tensor]) -> float:
    """``1 - Var(R - V) / Var(R)`` over every token: 1 for a perfect critic, 0 for a constant one,
    negative when it is worse than its mean. NaN when the returns do not vary."""
    if not values:
        return float("nan")
    v, r = torch.cat([x.double() for x in values]), torch.cat([x.double() for x in returns])
    if r.numel() < 2:
        return float("nan")
    var_r = r.var()
    return float("nan") if var_r == 0 else float(1 - (r - v).var() / var_r)


def value_loss(values: Tensor, old_values: Tensor | None, returns: Tensor, mask: Tensor, clip: float,
               ) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss ``[B, T]`` and where the clipped term was the larger one (as 0/1)."""
    unclipped = (values - returns) ** 2
    if clip <= 0 or old_values is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


@dataclass
class ValueInput:
    """One micro-batch as the value objective sees it; every tensor is response-aligned ``[B, T]``."""

    values: Tensor
    """The critic's values of the response positions (with gradient)."""
    mask: Tensor
    fields: dict[str, Tensor]
    """Other per-token sample fields: ``returns`` (the targets) and ``values`` (before this batch's
    updates, for clipping)."""


class ValueObjective:
    """Callable: ``ValueInput -> (loss, stats)``, the critic's loss. ``head = "value"`` tells the
    engine to hand over the value head's output rather than log-probs."""

    head = "value"
    needs_logits = False
    reads: tuple[str, ...] = ()
    """Sample fields read beyond the critic_train phase's own (none)."""

    def __init__(self, algo: AlgoConfig) -> None:
        agg = AGGREGATIONS.get(str(algo.loss_agg))
        self.aggregation, self.algo = agg, algo
        self.agg = lambda per_token, mask: agg(per_token, mask, algo)
        self.denominator: float | None = None
        """Set by ``split``: the loss is its total over the micro-batch divided by this."""
        self.clip = float(algo.value_clip)

    def token_mask(self, sample: dict[str, Tensor]) -> Tensor:
        """The response tokens of ``sample`` that count in the value loss (as ``__call__`` masks
        them): every one, but where its ``loss_mask`` is 0 (a multi-turn trajectory's observation
        tokens: states the policy did not act in)."""
        mask = torch.ones(len(sample["response"]))
        return mask * sample["loss_mask"].float() if "loss_mask" in sample else mask

    def split(self, denominator: float) -> ValueObjective:
        """This objective with the loss the micro-batch's total divided by ``denominator``
        (``rlbatch.algos.split.split_objective``)."""
        return split_objective(self, denominator)

    def __call__(self, x: ValueInput) -> tuple[Tensor, dict[str, float]]:
        if "returns" not in x.fields:
            raise ValueError("the value objective needs each sample's per-token 'returns'")
        mask = x.mask * x.fields["loss_mask"] if "loss_mask" in x.fields else x.mask
        per_token, clipped = value_loss(x.values, x.fields.get("values"), x.fields["returns"], mask, self.clip)
        loss = self.agg(per_token, mask)
        return loss, {"value_loss": loss.item() * loss_stat_factor(self, mask), "value_clip_frac": masked_mean(clipped, mask).item(),
                      "value_mean": masked_mean(x.values.detach(), mask).item()}
