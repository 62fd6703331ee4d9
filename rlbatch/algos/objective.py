"""The training objective a training engine minimises, built from the algorithm's registered parts.

An engine computes the log-probs of the response tokens (and the logits, when the objective
asks for them) and hands them over as a ``LossInput``; it never knows the algorithm. The
objective is policy loss + kl_coef * KL(policy || reference) - entropy_coef * entropy, each
aggregated over the response tokens with the configured aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlbatch.algos import core
from rlbatch.algos.offpolicy import importance_ratio, ratio_stats
from rlbatch.algos.registry import AGGREGATIONS, KL_ESTIMATORS, OFF_POLICY, POLICY_LOSSES, SEQUENCE_CORRECTIONS
from rlbatch.algos.split import loss_stat_factor, split_objective
from rlbatch.algos.value import ValueObjective

if TYPE_CHECKING:
    from rlbatch.config.schema import AlgoConfig


@dataclass
class LossInput:
    """One micro-batch as the objective sees it; every tensor is response-aligned ``[B, T]``."""

    logp: Tensor
    """Log-probs of the sampled tokens under the policy being trained (with gradient)."""
    mask: Tensor
    """1.0 on response tokens, 0.0 on padding."""
    advantages: Tensor
    """Per-token advantages (a per-sequence advantage broadcast over its tokens)."""
    fields: dict[str, Tensor]
    """Other per-token sample fields present in the batch: old_logprobs, ref_logprobs, loss_mask
    (0 on the tokens of a sample kept out of the loss), ..."""
    logits: Tensor | None = None
    """``[B, T, V]`` logits of the response positions, when ``needs_logits`` (and the engine keeps them)."""
    entropy: Tensor | None = None
    """``[B, T]`` entropy of each response position (with gradient), when ``needs_logits`` and the
    engine computes it without keeping the logits (``rlbatch.algos.core.chunked_logprobs``)."""


class PolicyObjective:
    """Callable: ``LossInput -> (loss, stats)``. Stats are plain floats, summed over micro-batches
    by the engine and averaged over updates. ``head = "lm"``: the engine hands over log-probs of
    the language-model head (a critic's objective, ``rlbatch.algos.value.ValueObjective``, asks for
    the value head's output instead)."""

    head = "lm"

    def __init__(self, algo: AlgoConfig) -> None:
        agg = AGGREGATIONS.get(str(algo.loss_agg))
        self.aggregation = agg
        self.agg = lambda per_token, mask: agg(per_token, mask, algo)
        self.denominator: float | None = None
        """Set by ``split``: each loss term is its total over the micro-batch divided by this."""
        self.policy_loss = POLICY_LOSSES.get(str(getattr(algo, "policy_loss", "ppo_clip")))
        self.kl = KL_ESTIMATORS.get(str(algo.kl_estimator))
        self.kl_coef = float(algo.kl_coef) if not algo.kl_in_reward else 0.0
        self.entropy_coef = float(algo.entropy_coef)
        name = str(getattr(algo, "off_policy", "none"))
        self.correction = OFF_POLICY.get(name) if name != "none" else None
        self.sequence_level = name in SEQUENCE_CORRECTIONS
        self.reads: tuple[str, ...] = ("behaviour_logprobs",) if self.correction is not None else ()
        """Sample fields the objective reads beyond the train phase's own (``rlbatch.phases``)."""
        self.algo = algo

    needs_logits = True
    """The engine hands over the logits too: the entropy is a per-step metric (and a loss term
    with ``entropy_coef > 0``)."""

    def __call__(self, x: LossInput) -> tuple[Tensor, dict[str, float]]:
        # Without old log-probs the batch is on-policy: old = current, detached (exact only before
        # the first update; the engine refuses it after).
        old = x.fields.get("old_logprobs", x.logp.detach())
        # A per-sample loss mask (DAPO's overlong filtering) takes tokens out of every term and count.
        mask = x.mask * x.fields["loss_mask"] if "loss_mask" in x.fields else x.mask
        advantages, correction = x.advantages, {}
        if self.correction is not None:  # the sampler's policy differs from the trainer's: weigh or drop tokens
            ratio = importance_ratio(old, x.fields["behaviour_logprobs"])
            weight, keep = self.correction(ratio, mask, self.algo)
            correction = ratio_stats(ratio, weight, keep, mask, self.sequence_level)
            advantages, mask = advantages * weight, mask * keep
        loss, clip = self.policy_loss(x.logp, old, advantages, mask, self.algo, self.agg)
        f = loss_stat_factor(self, mask)
        stats = correction | {"pg_loss": loss.item() * f, "clip_frac": clip.clip_frac.item(), "clip_frac_low": clip.clip_frac_low.item(),
                 "clip_frac_high": clip.clip_frac_high.item(), "approx_kl_old": clip.approx_kl.item()}
        if "loss_mask" in x.fields:
            stats["loss_masked_frac"] = 1.0 - (mask.sum() / x.mask.sum().clamp(min=1.0)).item()
        if self.kl_coef > 0:
            if "ref_logprobs" not in x.fields:  # a phase or a restored buffer lost them: never train without the KL
                raise ValueError(f"train: algo.kl_coef={self.kl_coef} but the batch has no reference log-probs "
                                 f"(fields: {sorted(x.fields)})")
            kl = self.agg(self.kl(x.logp, x.fields["ref_logprobs"]), mask)
            loss = loss + self.kl_coef * kl
            stats["kl_ref"] = kl.item() * f
        if self.entropy_coef > 0:
            per_token = x.entropy
            if per_token is None:
                assert x.logits is not None, "the objective needs logits or entropy (entropy_coef > 0)"
                per_token = core.entropy_from_logits(x.logits)
            ent = self.agg(per_token, mask)
            loss = loss - self.entropy_coef * ent
            stats["entropy"] = ent.item() * f
        elif x.entropy is not None:
            stats["entropy"] = self.agg(x.entropy.detach(), mask).item() * f
        elif x.logits is not None:
            stats["entropy"] = self.agg(core.entropy_for_stats(x.logits), mask).item() * f
        return loss, stats

    def token_mask(self, sample: dict[str, Tensor]) -> Tensor:
        """The response tokens of ``sample`` that count in the loss (as ``__call__`` masks them):
        its loss mask times the off-policy correction's keep mask."""
        mask = torch.ones(len(sample["response"]))
        if "loss_mask" in sample:
            mask = mask * sample["loss_mask"].float()
        if self.correction is not None:
            if "old_logprobs" not in sample:  # keep = f(current log-probs): unknown before the forward
                raise ValueError(f"train: algo.off_policy={self.algo.off_policy!r} keeps tokens by their old log-probs, "
                                 f"which a sample of the first mini-batch lacks, so the loss's denominator is unknown "
                                 f"before the forward (the engine computes them first where it can: "
                                 f"rlbatch.engines.training.weighted_updates)")
            ratio = importance_ratio(sample["old_logprobs"], sample["behaviour_logprobs"])[None]
            mask = mask * self.correction(ratio, mask[None], self.algo)[1][0]
        return mask

    def needs_old_logprobs(self, samples: list[dict[str, Tensor]]) -> bool:
        """Whether ``token_mask`` needs old log-probs some of ``samples`` lack (an off-policy
        correction keeps tokens by them): the engine then computes them before the forward."""
        return self.correction is not None and any("old_logprobs" not in s for s in samples)

    def split(self, denominator: float) -> PolicyObjective:
        """This objective with every loss term the micro-batch's total divided by ``denominator``."""
        return split_objective(self, denominator)


def objective_for(role: str, algo: AlgoConfig) -> PolicyObjective | ValueObjective:
    """The loss a trainable role minimises: the critic regresses values (``ValueObjective``),
    actor_train follows the policy objective."""
    from rlbatch.config.schema import VALUE_ROLES

    if role in VALUE_ROLES:
        return ValueObjective(algo)
    return PolicyObjective(algo)
