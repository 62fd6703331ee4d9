"""Registries of the algorithm's parts, by name: advantage estimators, policy losses, KL
estimators, loss aggregations, and the programs (loops) that use them.

Torch-free: an entry is a ``'module:function'`` path imported when first used, so validation
checks names before anything starts without importing torch. An algorithm is added by
registering its parts here (or from a plugin module with ``register``) and, only where its loop
differs, a program; no engine changes.

    ADVANTAGES      (rewards [N], group_size, algo cfg, *, lengths, kl) -> advantages [N] or
                    per-token (N tensors); kl: per-token KL of each response when algo.kl_in_reward.
                    The value-based ones (VALUE_ADVANTAGES: gae) also take the critic's per-token
                    ``values`` and return (advantages, returns)
    POLICY_LOSSES   (logp, old_logp, advantages [B,T], mask, algo cfg, aggregate) -> (loss, ClipStats)
    KL_ESTIMATORS   (logp, ref_logp) -> per-token KL estimate
    AGGREGATIONS    (per_token [B,T], mask, algo cfg) -> scalar; an entry with ``total`` (the
                    numerator, a sum over rows) and ``count`` (the denominator, additive over rows),
                    as ``rlbatch.algos.estimators.Aggregation``, also trains under any micro-batch
                    split (``engine_args.max_tokens_per_micro_batch``) with the unsplit batch's loss
    OFF_POLICY      (ratio [B,T], mask, algo cfg) -> (weight [B,T], keep [B,T]): the correction for
                    tokens sampled by another policy (ratio: old policy / behaviour policy, per
                    token; a sequence-level entry reads the rows of ``mask``)
    LOOPS           the controller loop (the program) for algo.name
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry:
    """Name -> callable, imported lazily from a 'module:attr' path."""

    def __init__(self, what: str, field: str, entries: dict[str, str]) -> None:
        self.what, self.field = what, field
        self._entries: dict[str, str | Callable[..., Any]] = dict(entries)

    def register(self, name: str, target: str | Callable[..., Any]) -> None:
        self._entries[name] = target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def problem(self, name: Any) -> str | None:
        """A validation message when ``name`` is not registered, else None."""
        if name in self._entries:
            return None
        return f"{self.field}: {name!r} is not a registered {self.what}; registered: {self.names()}"

    def get(self, name: str) -> Callable[..., Any]:
        if name not in self._entries:
            raise KeyError(self.problem(name))
        target = self._entries[name]
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            target = getattr(importlib.import_module(module), attr)
            self._entries[name] = target
        return target


ADVANTAGES = Registry("advantage estimator", "algo.advantage", {
    "grpo": "rlbatch.algos.estimators:grpo",
    "dr_grpo": "rlbatch.algos.estimators:dr_grpo",
    "rloo": "rlbatch.algos.estimators:rloo",
    "reinforce_pp": "rlbatch.algos.estimators:reinforce_pp",
    "reinforce_pp_baseline": "rlbatch.algos.estimators:reinforce_pp_baseline",
    "gae": "rlbatch.algos.value:gae_estimator",
})
POLICY_LOSSES = Registry("policy loss", "algo.policy_loss", {
    "ppo_clip": "rlbatch.algos.estimators:ppo_clip",
    "gspo": "rlbatch.algos.estimators:gspo",
})
KL_ESTIMATORS = Registry("KL estimator", "algo.kl_estimator", {
    "k1": "rlbatch.algos.estimators:kl_k1",
    "k2": "rlbatch.algos.estimators:kl_k2",
    "k3": "rlbatch.algos.estimators:kl_k3",
    "abs": "rlbatch.algos.estimators:kl_abs",
})
AGGREGATIONS = Registry("loss aggregation", "algo.loss_agg", {
    "token": "rlbatch.algos.estimators:agg_token",
    "seq": "rlbatch.algos.estimators:agg_seq",
    "seq_sum": "rlbatch.algos.estimators:agg_seq_sum",
})
OFF_POLICY = Registry("off-policy correction", "algo.off_policy", {
    "none": "rlbatch.algos.offpolicy:no_correction",
    "tis": "rlbatch.algos.offpolicy:truncated_is",
    "mask": "rlbatch.algos.offpolicy:ratio_mask",
    "seq_tis": "rlbatch.algos.offpolicy:seq_truncated_is",
    "seq_mask": "rlbatch.algos.offpolicy:seq_ratio_mask",
})
SEQUENCE_CORRECTIONS: set[str] = {"seq_tis", "seq_mask"}
"""Off-policy corrections that weigh or drop whole sequences by their geometric-mean ratio (their
statistics count a token as truncated against its sequence's ratio). A plugin adds the name of
such a correction it registers."""
LOOPS = Registry("algorithm (program)", "algo.name", {
    **{name: "rlbatch.loop.program:policy_gradient"
       for name in ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline")},
    "ppo": "rlbatch.loop.program:ppo",
})
"""algo.name -> the controller loop. The critic-free family shares one policy-gradient loop
(generate, score, reference/old log-probs, advantages from rewards, train, sync; DAPO's dynamic
sampling is its ``algo.dynamic_sampling`` switch); the name says which preset the run follows."""

GROUP_ADVANTAGES: set[str] = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}
"""Advantage estimators that compare the samples of one prompt's group: they need
samples_per_prompt >= 2. A plugin adds the name of such an estimator it registers."""

ALL = (ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS, OFF_POLICY, LOOPS)

USES_CRITIC: set[str] = {"ppo"}
"""Programs that run the critic role (values, critic training); they need it enabled, and the
others refuse it. A plugin that registers such a program adds its name."""

VALUE_ADVANTAGES: set[str] = {"gae"}
"""Advantage estimators that read the critic's values and return (advantages, returns): only the
programs of ``USES_CRITIC`` run them, and those run nothing else."""
