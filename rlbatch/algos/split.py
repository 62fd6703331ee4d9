"""An objective split over micro-batches: each micro-batch's loss is its aggregation's total over
the whole batch's count (``split_objective``), so the micro-batches' losses add up to the unsplit
batch's; the count is additive over samples (``aggregation_count``). Shared by the policy objective
(``rlbatch.algos.objective``) and the critic's (``rlbatch.algos.value``)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor


def aggregation_count(objective: Any, samples: list[dict[str, Tensor]]) -> float:
    """The denominator of ``objective``'s aggregation over ``samples``, each masked by
    ``objective.token_mask``: additive over samples, so micro-batches' and ranks' counts sum to the
    whole batch's."""
    count = getattr(objective.aggregation, "count", None)
    if count is None:
        raise ValueError(f"loss aggregation {objective.algo.loss_agg!r} has no count (denominator): register an "
                         f"aggregation with total and count (rlbatch.algos.estimators.Aggregation) to train with "
                         f"engine_args.max_tokens_per_micro_batch")
    if not samples:
        return 0.0
    masks = torch.nn.utils.rnn.pad_sequence([objective.token_mask(s) for s in samples], batch_first=True)
    return float(count(masks, objective.algo))


def split_objective(objective: Any, denominator: float) -> Any:
    """A copy of ``objective`` whose aggregation is the micro-batch's total over ``denominator``
    (the whole batch's count, or a rank's share of it): the micro-batches' losses then add up to
    the unsplit batch's. Its loss stats stay per-micro-batch means (total over the micro-batch's
    own count), so the engine weighs them like the other stats."""
    if getattr(objective.aggregation, "total", None) is None:
        aggregation_count(objective, [])  # raises the message naming the aggregation
    out = copy.copy(objective)
    total, algo = objective.aggregation.total, objective.algo
    out.denominator = float(denominator)
    out.agg = lambda per_token, mask: total(per_token, mask, algo) / out.denominator
    return out


def loss_stat_factor(objective: Any, mask: Tensor) -> float:
    """1, or for a split objective what turns a loss term back into the micro-batch's mean."""
    if objective.denominator is None:
        return 1.0
    return objective.denominator / max(float(objective.aggregation.count(mask, objective.algo)), 1.0)
