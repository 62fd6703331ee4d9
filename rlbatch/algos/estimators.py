"""The registered algorithm parts (see ``rlbatch.algos.registry``): thin adapters from the
config to the pure tensor functions of ``rlbatch.algos.core`` and ``rlbatch.algos.advantages``.

Advantage estimators take ``(rewards [N], group_size, algo, *, lengths, kl)``: ``lengths`` are the
response lengths, ``kl`` the per-token KL to the reference of each response when
``algo.kl_in_reward`` (else None). One that also takes ``turn_rewards`` gets, in a multi-turn run,
each trajectory's per-turn env rewards at their turns' last tokens (``advantages.TurnRewards``;
``rewards`` still holds each whole reward). Sequence-level estimators subtract ``kl_coef * sum_t KL_t`` from
the reward; token-level ones put ``-kl_coef * KL_t`` on each token.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from torch import Tensor

from rlbatch.algos import advantages as adv
from rlbatch.algos import core

if TYPE_CHECKING:
    from rlbatch.config.schema import AlgoConfig


def _kl_shaped(rewards: Tensor, kl: list[Tensor] | None, algo: AlgoConfig) -> Tensor:
    if kl is None:
        return rewards.float()
    return rewards.float() - float(algo.kl_coef) * Tensor([float(k.sum()) for k in kl])


def grpo(rewards: Tensor, group_size: int, algo: AlgoConfig, *, lengths: list[int] | None = None,
         kl: list[Tensor] | None = None) -> Tensor:
    """Group-relative: each reward minus its group's mean, over the group's std (+ adv_eps)."""
    return core.grpo_advantages(_kl_shaped(rewards, kl, algo), group_size, float(algo.adv_eps))


def dr_grpo(rewards: Tensor, group_size: int, algo: AlgoConfig, *, lengths: list[int] | None = None,
            kl: list[Tensor] | None = None) -> Tensor:
    """Dr.GRPO: each reward minus its group's mean, not divided by the std (no difficulty bias)."""
    return core.grpo_advantages(_kl_shaped(rewards, kl, algo), group_size, std_normalize=False)


def rloo(rewards: Tensor, group_size: int, algo: AlgoConfig, *, lengths: list[int] | None = None,
         kl: list[Tensor] | None = None) -> Tensor:
    """RLOO: each reward minus the mean of the other samples of its group."""
    return adv.rloo_advantages(_kl_shaped(rewards, kl, algo), group_size)


def _lengths(lengths: list[int] | None) -> list[int]:
    if lengths is None:
        raise ValueError("per-token advantage estimators need the response lengths")
    return lengths


def reinforce_pp(rewards: Tensor, group_size: int, algo: AlgoConfig, *, lengths: list[int] | None = None,
                 kl: list[Tensor] | None = None, turn_rewards: adv.TurnRewards | None = None) -> list[Tensor]:
    """REINFORCE++: per-token returns (KL on each token when kl_in_reward; a trajectory's per-turn
    rewards at their turns), whitened over the batch."""
    return adv.reinforce_pp_advantages(rewards, _lengths(lengths), kl, float(algo.kl_coef), float(algo.gamma),
                                       None, float(algo.adv_eps), turn_rewards)


def reinforce_pp_baseline(rewards: Tensor, group_size: int, algo: AlgoConfig, *, lengths: list[int] | None = None,
                          kl: list[Tensor] | None = None, turn_rewards: adv.TurnRewards | None = None) -> list[Tensor]:
    """REINFORCE++-baseline: REINFORCE++ after subtracting each group's mean reward."""
    return adv.reinforce_pp_advantages(rewards, _lengths(lengths), kl, float(algo.kl_coef), float(algo.gamma),
                                       group_size, float(algo.adv_eps), turn_rewards)


def ppo_clip(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, algo: AlgoConfig,
             agg: core.Aggregator) -> tuple[Tensor, core.ClipStats]:
    """PPO's clipped surrogate with separate low/high clip ranges (DAPO's clip-higher)."""
    return core.ppo_clip_loss(logp, old_logp, advantages, mask, float(algo.clip_low), float(algo.clip_high), agg)


def gspo(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, algo: AlgoConfig,
         agg: core.Aggregator) -> tuple[Tensor, core.ClipStats]:
    """GSPO: one importance ratio per sequence, clipped with clip_low/clip_high."""
    return core.gspo_loss(logp, old_logp, advantages, mask, float(algo.clip_low), float(algo.clip_high), agg)


# The KL estimators of core, one registry entry each.
kl_k1 = partial(core.kl_penalty, kind="k1")
kl_k2 = partial(core.kl_penalty, kind="k2")
kl_k3 = partial(core.kl_penalty, kind="k3")
kl_abs = partial(core.kl_penalty, kind="abs")


# Aggregations: (per_token [B, T], mask, algo) -> scalar; each also gives its numerator (``total``)
# and denominator (``count``) so an engine can split a mini-batch anyhow and keep its exact loss.
class Aggregation:
    """A registered loss aggregation: ``agg(per_token, mask, algo)`` is ``core.aggregate``;
    ``agg.total`` its numerator (a sum over rows) and ``agg.count`` its denominator (additive over
    rows), so a loss split over micro-batches and ranks is ``sum(total) / sum(count)``."""

    def __init__(self, kind: core.LossAgg, doc: str) -> None:
        self.kind = kind
        self.__doc__ = doc

    def _norm(self, algo: AlgoConfig | None) -> float | None:
        if self.kind != "seq_sum":
            return None
        if algo is None:
            raise ValueError("loss aggregation 'seq_sum' divides by algo.max_new_tokens: pass the algorithm config")
        return float(algo.max_new_tokens)

    def __call__(self, per_token: Tensor, mask: Tensor, algo: AlgoConfig | None = None) -> Tensor:
        return core.aggregate(per_token, mask, self.kind, self._norm(algo))

    def total(self, per_token: Tensor, mask: Tensor, algo: AlgoConfig | None = None) -> Tensor:
        return core.aggregate_total(per_token, mask, self.kind, self._norm(algo))

    def count(self, mask: Tensor, algo: AlgoConfig | None = None) -> Tensor:
        return core.aggregate_count(mask, self.kind)


agg_token = Aggregation("token", "Token mean over the batch (DAPO): total = token sum, count = valid tokens.")
agg_seq = Aggregation("seq", "Mean of per-sequence token means (GRPO): count = sequences with a valid token.")
agg_seq_sum = Aggregation("seq_sum", "Dr.GRPO: token sums over the constant max_new_tokens, averaged over "
                                     "sequences: total = token sum / max_new_tokens, count = sequences.")
