"""GRPO/PPO math against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlbatch.algos import (
    aggregate,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    ppo_clip_loss,
    token_logprobs,
)


def close(actual: torch.Tensor, expected: object, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# ---------------------------------------------------------------- advantages


def test_grpo_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # group 1: mean 0.25, unbiased std 0.5; group 2: mean 0.5, unbiased std sqrt(1/3)
    s = 0.5 / math.sqrt(1 / 3)
    close(grpo_advantages(rewards, 4, eps=0.0), [1.5, -0.5, -0.5, -0.5, s, s, -s, -s])


def test_grpo_advantages_without_std_are_centred_rewards() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    close(
        grpo_advantages(rewards, 4, std_normalize=False),
        [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5],
    )


def test_grpo_advantages_zero_for_group_with_equal_rewards() -> None:
    adv = grpo_advantages(torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 1.0]), 3)
    close(adv[:3], [0.0, 0.0, 0.0])
    assert torch.isfinite(adv).all()
    assert adv[3] > 0 > adv[4]


def test_grpo_advantages_rejects_batch_not_divisible_by_group() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(torch.zeros(6), 4)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_values() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    close(kl_penalty(logp, ref, "k1"), [math.log(2)])
    close(kl_penalty(logp, ref, "k2"), [0.5 * math.log(2) ** 2])
    close(kl_penalty(logp, ref, "k3"), [0.5 + math.log(2) - 1])  # exp(r) - r - 1, r = -log 2
    close(kl_penalty(logp, ref, "abs"), [math.log(2)])
    close(kl_penalty(ref, logp, "k1"), [-math.log(2)])  # k1 can go negative, k3 cannot
    assert kl_penalty(ref, logp, "k3").item() > 0


def test_k1_and_k3_estimate_true_kl_from_policy_samples() -> None:
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    true_kl = (p * (p / q).log()).sum().item()
    gen = torch.Generator().manual_seed(0)
    x = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    for kind in ("k1", "k3"):
        est = kl_penalty(p.log()[x], q.log()[x], kind).mean().item()
        assert abs(est - true_kl) < 0.01, (kind, est, true_kl)


def test_k3_is_capped_for_tokens_the_policy_made_very_unlikely() -> None:
    logp = torch.tensor([-30.0, -3.0], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([-1.0, -3.0]), "k3")
    close(kl.detach(), [10.0, 0.0])  # uncapped it would be exp(29) ~ 4e12
    kl.sum().backward()
    assert logp.grad is not None
    close(logp.grad, [0.0, 0.0])


def test_kl_penalty_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k5"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k5")  # type: ignore[arg-type]


# ---------------------------------------------------------------- PPO clip loss

# Row 0 (A=+1): ratios 1.5 (clipped high to 1.3), 0.5 (A>0: not clipped), 1.1.
# Row 1 (A=-1): ratios 1.5 (A<0: not clipped), 0.5 (clipped low to 0.8), 9.0 (masked out).
RATIOS = [[1.5, 0.5, 1.1], [1.5, 0.5, 9.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -1.0]


def _clip_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor(RATIOS).log().requires_grad_(True)
    return logp, torch.zeros(2, 3), torch.tensor(ADV), torch.tensor(MASK)


def test_ppo_clip_loss_token_aggregation_hand_value() -> None:
    logp, old, adv, mask = _clip_inputs()
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3, agg="token")
    # per token: -1.3, -0.5, -1.1 | 1.5, 0.8 -> mean over 5 valid tokens
    close(loss.detach(), (-1.3 - 0.5 - 1.1 + 1.5 + 0.8) / 5)
    close(stats.clip_frac, 0.4)
    close(stats.clip_frac_high, 0.2)
    close(stats.clip_frac_low, 0.2)
    # k3 of KL(old || new) = ratio - log(ratio) - 1, averaged over valid tokens
    f = [r - math.log(r) - 1 for r in (1.5, 0.5, 1.1, 1.5, 0.5)]
    close(stats.approx_kl, sum(f) / 5)


def test_ppo_clip_loss_sequence_aggregation_weighs_rows_equally() -> None:
    logp, old, adv, mask = _clip_inputs()
    loss, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3, agg="seq")
    close(loss.detach(), ((-1.3 - 0.5 - 1.1) / 3 + (1.5 + 0.8) / 2) / 2)


def test_ppo_clip_loss_gradient_vanishes_on_clipped_and_masked_tokens() -> None:
    logp, old, adv, mask = _clip_inputs()
    loss, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.3, agg="token")
    loss.backward()
    # d/dlogp of -A * ratio is -A * ratio; divided by the 5 valid tokens
    assert logp.grad is not None
    close(logp.grad, [[0.0, -0.5 / 5, -1.1 / 5], [1.5 / 5, 0.0, 0.0]])


def test_ppo_clip_low_and_high_are_independent() -> None:
    logp, old, adv, mask = _clip_inputs()
    sym, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    wide_high, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.6)
    wide_low, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.6, clip_high=0.2)
    close(sym.detach(), (-1.2 - 0.5 - 1.1 + 1.5 + 0.8) / 5)
    close(wide_high.detach(), (-1.5 - 0.5 - 1.1 + 1.5 + 0.8) / 5)  # 1.5 now inside the range
    close(wide_low.detach(), (-1.2 - 0.5 - 1.1 + 1.5 + 0.5) / 5)  # 0.5 now above 1 - 0.6


def test_ppo_clip_loss_on_policy_is_minus_mean_advantage() -> None:
    logp = torch.randn(4, 5)
    adv = torch.tensor([2.0, -1.0, 0.5, 0.0])
    loss, stats = ppo_clip_loss(logp, logp.clone(), adv, torch.ones(4, 5), agg="seq")
    close(loss, -adv.mean().item())
    close(stats.clip_frac, 0.0)
    close(stats.approx_kl, 0.0)


def test_ppo_clip_loss_accepts_per_token_advantages() -> None:
    logp, old, _, mask = _clip_inputs()
    per_token = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    a, _ = ppo_clip_loss(logp, old, torch.tensor(ADV), mask, 0.2, 0.3)
    b, _ = ppo_clip_loss(logp, old, per_token, mask, 0.2, 0.3)
    close(b.detach(), a.item())


def test_aggregate_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="'sum'"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2), "sum")  # type: ignore[arg-type]


def test_masked_mean_ignores_masked_values_and_empty_rows() -> None:
    values = torch.tensor([[1.0, 3.0, 100.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(masked_mean(values, mask), 2.0)
    close(masked_mean(values, mask, dim=-1), [2.0, 0.0])
    # a sequence with no valid token must not count in "seq" aggregation
    close(aggregate(values, mask, "seq"), 2.0)


# ---------------------------------------------------------------- log-probs / entropy


def test_token_logprobs_match_log_softmax() -> None:
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(1)) * 3
    targets = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(2))
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    close(token_logprobs(logits, targets), expected.tolist())


def test_token_logprobs_upcast_bf16_and_stay_differentiable() -> None:
    logits = torch.randn(2, 3, 7).bfloat16().requires_grad_(True)
    targets = torch.zeros(2, 3, dtype=torch.long)
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_entropy_from_logits_uniform_and_peaked() -> None:
    close(entropy_from_logits(torch.zeros(2, 8)), [math.log(8)] * 2)
    peaked = torch.tensor([[50.0, 0.0, 0.0]])
    assert entropy_from_logits(peaked).item() < 1e-6

