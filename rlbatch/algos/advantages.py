"""Advantage estimators of the critic-free family, and the reward shaping they share.

Pure tensor functions. Rewards are ``[N]`` with the ``group_size`` samples of one prompt
adjacent; per-token quantities are lists of N 1-D tensors (one per response, possibly empty).

    RLOO            r_i - mean of the other samples of its group
    REINFORCE++     per-token returns of (task reward on the last token - kl_coef * KL_t),
                    whitened over every token of the batch
    REINFORCE++-baseline  the same after subtracting the group mean from the task reward

and DAPO's two treatments of long responses: overlong shaping (a reward penalty) and overlong
filtering (truncated responses kept out of the loss).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rlbatch.config.schema import AlgoConfig


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Leave-one-out baseline: ``A_i = r_i - (sum_j r_j - r_i) / (G - 1)`` within each group.

    Equal to ``G / (G - 1)`` times the centred reward. A group of one has no other sample to
    compare with, so it is refused rather than given a silent zero."""
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per group (a leave-one-out baseline), got {group_size}")
    g = _groups(rewards, group_size)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - others).view(-1)


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """``[N / group_size]`` bool: the groups whose rewards are all equal (no learning signal for a
    group-relative estimator; DAPO's dynamic sampling replaces them)."""
    g = _groups(rewards, group_size)
    return (g == g[:, :1]).all(dim=1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, ``<= 0`` per response, added to the reward.

    0 up to ``max_len - buffer`` tokens, then falling linearly to ``-factor`` at ``max_len``
    (``factor * ((max_len - buffer) - length) / buffer``), and ``-factor`` beyond it. ``buffer=0``
    disables it."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} is longer than the longest response {max_len}")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)


def truncated(lengths: Tensor, ended_with_eos: Tensor, max_len: int) -> Tensor:
    """``[N]`` bool: the responses that ran out of tokens, ``max_len`` tokens long without EOS at
    the end. A response that stopped with EOS on its last allowed token is not truncated."""
    return (lengths >= max_len) & ~ended_with_eos.bool()


def response_loss_mask(response: Tensor, eos_id: int, max_len: int) -> Tensor:
    """DAPO's overlong filtering for one response: its per-token loss mask, all 0 when it is
    truncated (``max_len`` tokens, the last not ``eos_id``), else all 1. A zero mask keeps the
    sample's tokens out of the loss and out of the aggregation's token count (its advantage then
    weighs nothing), so the other samples' loss is not diluted."""
    n = response.numel()
    ended = torch.tensor([n > 0 and int(response[-1]) == eos_id])
    cut = bool(truncated(torch.tensor([n]), ended, max_len)[0])
    return torch.full((n,), 0.0 if cut else 1.0)


TurnRewards = list[list[tuple[int, float]]]
"""Per sample, rewards that arrived during it as (token index, reward): a trajectory's per-turn
env rewards at the last token of the turn each followed (``Actions``)."""


def token_rewards(rewards: Tensor, lengths: list[int], kl: list[Tensor] | None, kl_coef: float,
                  turn_rewards: TurnRewards | None = None) -> list[Tensor]:
    """Per-token rewards: the sequence's reward on its last token, minus ``kl_coef * KL_t`` on
    every token (InstructGPT's KL-in-reward). With ``turn_rewards`` each sample's listed rewards sit
    at their tokens and the rest of its reward (the sequence's minus theirs: other scorers, shaping,
    a baseline) on its last token, so a sample's token rewards still sum to its reward. An empty
    response has no token to carry either."""
    out = []
    for i, n in enumerate(lengths):
        r = torch.zeros(n, dtype=torch.float32)
        if kl is not None:
            if kl[i].numel() != n:
                raise ValueError(f"sample {i}: {kl[i].numel()} per-token KL values for a response of {n} tokens")
            r -= kl_coef * kl[i].float()
        if n:
            rest = rewards[i].float()
            for t, value in (turn_rewards[i] if turn_rewards is not None else ()):
                if not 0 <= t < n:
                    raise ValueError(f"sample {i}: a turn's reward at token {t} of a response of {n} tokens")
                r[t] += value
                rest = rest - value
            r[-1] += rest
        out.append(r)
    return out


def returns_to_go(per_token: list[Tensor], gamma: float) -> list[Tensor]:
    """``G_t = r_t + gamma * G_{t+1}`` within each response (no bootstrap past its end)."""
    out = []
    for r in per_token:
        g = torch.zeros_like(r)
        running = torch.zeros((), dtype=r.dtype)
        for t in range(r.numel() - 1, -1, -1):
            running = r[t] + gamma * running
            g[t] = running
        out.append(g)
    return out


def whiten_tokens(per_token: list[Tensor], eps: float = 1e-8) -> list[Tensor]:
    """Subtract the mean and divide by the (unbiased) std over every token of the batch (the global
    normalisation of REINFORCE++). Fewer than two tokens: centred only."""
    flat = torch.cat([t.float() for t in per_token]) if per_token else torch.zeros(0)
    if flat.numel() == 0:
        return [t.float() for t in per_token]
    mean = flat.mean()
    std = flat.std() if flat.numel() > 1 else torch.ones(())
    return [(t.float() - mean) / (std + eps) for t in per_token]


def reinforce_pp_advantages(rewards: Tensor, lengths: list[int], kl: list[Tensor] | None, kl_coef: float,
                            gamma: float, group_size: int | None = None, eps: float = 1e-8,
                            turn_rewards: TurnRewards | None = None) -> list[Tensor]:
    """REINFORCE++ (``group_size=None``) or REINFORCE++-baseline (the group's mean reward
    subtracted first, from what sits on the last token): per-token returns of the shaped rewards
    (``token_rewards``), whitened over the batch's tokens."""
    if group_size is not None:
        g = _groups(rewards, group_size)
        rewards = (g - g.mean(dim=1, keepdim=True)).view(-1)
    return whiten_tokens(returns_to_go(token_rewards(rewards, lengths, kl, kl_coef, turn_rewards), gamma), eps)


class Actions:
    """The policy's own tokens of each response: in a trajectory its generated turns, not the
    observations between them (``loss_mask``); a single-turn response is all action. Per-token
    estimators run on the actions alone (``estimate``): returns and GAE step from one action to the
    next across an observation, the sequence reward sits on the last action (but for the per-turn
    rewards given to an estimator that takes them, each at its turn's last action), whitening
    counts actions only, and observation tokens get 0 (as verl's masked GAE does)."""

    def __init__(self, masks: list[Tensor], turn_rewards: TurnRewards | None = None) -> None:
        self.masks = [m.bool() for m in masks]
        self.turn_rewards = turn_rewards
        """Each response's per-turn rewards at the index (among its actions) of the last token of
        the turn each followed: an estimator that takes ``turn_rewards`` gets them."""

    def take(self, per_token: list[Tensor]) -> list[Tensor]:
        """Each response's values at its actions."""
        return [t[m] for t, m in zip(per_token, self.masks, strict=True)]

    def put(self, per_token: list[Tensor]) -> list[Tensor]:
        """Per-action values back at their positions of each response, 0 elsewhere."""
        out = []
        for t, m in zip(per_token, self.masks, strict=True):
            full = torch.zeros(m.numel(), dtype=t.dtype)
            full[m] = t
            out.append(full)
        return out

    def estimate(self, estimator: Any, rewards: Tensor, group_size: int, algo: AlgoConfig, *, kl: list[Tensor] | None = None,
                 values: list[Tensor] | None = None) -> Any:
        """``estimator`` (an ``ADVANTAGES`` entry) on the actions: its per-token outputs (lists)
        put back at the actions' positions; a sequence-level output ([N]) as it is."""
        kwargs: dict[str, Any] = {"lengths": [int(m.sum()) for m in self.masks],
                                  "kl": self.take(kl) if kl is not None else None}
        if values is not None:
            kwargs["values"] = self.take(values)
        if self.turn_rewards is not None and "turn_rewards" in inspect.signature(estimator).parameters:
            kwargs["turn_rewards"] = self.turn_rewards
        out = estimator(rewards, group_size, algo, **kwargs)
        if isinstance(out, tuple):
            return tuple(self.put(o) if isinstance(o, list) else o for o in out)
        return self.put(out) if isinstance(out, list) else out
