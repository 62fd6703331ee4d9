"""The reward role as a model on GPUs: a sequence-classification model scores each prompt + response,
optionally weighed with data.reward_fn's rule score (``reward_model.model_weight`` / ``rule_weight``).

The reward model may have a tokenizer of its own (``reward_model.path``): prompt and response are
then decoded with the policy's tokenizer and encoded with the reward model's; with the policy's own
tokenizer the token ids are scored as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlbatch.rewards.rules import rule_scorer

if TYPE_CHECKING:
    from rlbatch.config.schema import RLBatchConfig


class ModelScorer:
    """``(prompts, responses, answers) -> (rewards, counts)`` over token ids of the policy's
    tokenizer; ``engine.scores`` runs the model (collective over the reward role's ranks)."""

    def __init__(self, engine: Any, tokenizer: Any, policy_tokenizer: Any, cfg: RLBatchConfig) -> None:
        self.engine, self.tokenizer, self.policy_tokenizer = engine, tokenizer, policy_tokenizer
        self.model_weight = float(cfg.reward_model.model_weight)
        self.rule_weight = float(cfg.reward_model.rule_weight)
        self.rule = rule_scorer(cfg) if self.rule_weight else None

    def _encode(self, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.tokenizer is self.policy_tokenizer:
            return ids
        texts = [self.policy_tokenizer.decode(t.tolist(), skip_special_tokens=True) for t in ids]
        return [torch.tensor(t, dtype=torch.long) for t in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def __call__(self, prompts: list[torch.Tensor], responses: list[torch.Tensor], completions: list[str],
                 answers: list[str], sources: list[str] | None = None) -> tuple[list[float], dict[str, int]]:
        rewards = [0.0] * len(prompts)
        counts: dict[str, int] = {}
        if self.model_weight:
            samples = [{"prompt": p, "response": r}
                       for p, r in zip(self._encode(prompts), self._encode(responses), strict=True)]
            rewards = [self.model_weight * s for s in self.engine.scores(samples)]
        if self.rule is not None:
            rule, counts = self.rule(completions, answers, sources)
            rewards = [x + self.rule_weight * y for x, y in zip(rewards, rule, strict=True)]
        return rewards, counts
