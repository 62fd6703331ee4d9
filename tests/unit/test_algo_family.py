"""The GRPO family's estimators and losses against hand-computed values: Dr.GRPO, RLOO,
REINFORCE++ (and -baseline), GSPO's sequence ratio, the seq_sum aggregation, DAPO's overlong
shaping and dynamic sampling's group picking; with masks, empty responses and one-sample groups."""

from __future__ import annotations

import math

import pytest
import torch

from rlbatch.algos import advantages as adv
from rlbatch.algos import core
from rlbatch.algos.objective import LossInput, PolicyObjective
from rlbatch.algos.registry import ADVANTAGES, AGGREGATIONS, POLICY_LOSSES
from rlbatch.config.schema import AlgoConfig
from rlbatch.loop.controller import Rollouts
from rlbatch.loop.sampling import GroupPicker, select


def close(actual: torch.Tensor, expected: object, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.float(), torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=0)


# ---------------------------------------------------------------- advantages


def test_dr_grpo_centres_without_the_std() -> None:
    algo = AlgoConfig(advantage="dr_grpo")
    a = ADVANTAGES.get("dr_grpo")(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), 3, algo)
    close(a, [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])


def test_rloo_is_reward_minus_the_others_mean() -> None:
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
    # group 1: 1 - (0 + 0.5)/2 = 0.75; 0 - 0.75 = -0.75; 0.5 - 0.5 = 0; group 2 all equal: 0
    close(adv.rloo_advantages(r, 3), [0.75, -0.75, 0.0, 0.0, 0.0, 0.0])
    # = G/(G-1) * (r - mean)
    close(adv.rloo_advantages(r, 3), (r.view(2, 3) - r.view(2, 3).mean(1, keepdim=True)).view(-1) * 1.5)


def test_rloo_refuses_one_sample_groups() -> None:
    with pytest.raises(ValueError, match="at least 2 samples"):
        adv.rloo_advantages(torch.tensor([1.0, 0.0]), 1)


def test_one_sample_groups_give_grpo_and_dr_grpo_zero() -> None:
    algo = AlgoConfig()
    for name in ("grpo", "dr_grpo"):
        close(ADVANTAGES.get(name)(torch.tensor([1.0, 0.0, 0.3]), 1, algo), [0.0, 0.0, 0.0])


def test_token_rewards_put_the_reward_on_the_last_token_and_kl_on_each() -> None:
    kl = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([]), torch.tensor([0.5])]
    out = adv.token_rewards(torch.tensor([1.0, 1.0, 0.0]), [3, 0, 1], kl, 0.5)
    close(out[0], [-0.05, -0.1, 1.0 - 0.15])
    assert out[1].numel() == 0  # an empty response carries nothing
    close(out[2], [-0.25])
    with pytest.raises(ValueError, match="2 per-token KL values for a response of 3"):
        adv.token_rewards(torch.tensor([1.0]), [3], [torch.zeros(2)], 0.1)


def test_returns_to_go_follow_the_recursion() -> None:
    r = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([])]
    g = adv.returns_to_go(r, 0.5)
    # G2 = 3; G1 = 2 + 0.5*3 = 3.5; G0 = 1 + 0.5*3.5 = 2.75
    close(g[0], [2.75, 3.5, 3.0])
    assert g[1].numel() == 0


def test_reinforce_pp_whitens_returns_over_every_token() -> None:
    algo = AlgoConfig(kl_coef=0.1, gamma=1.0, adv_eps=0.0)
    kl = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    a = ADVANTAGES.get("reinforce_pp")(torch.tensor([1.0, 0.0]), 1, algo, lengths=[2, 1], kl=kl)
    # token rewards: [-0.1, 1 - 0.2] and [-0.3]; returns: [0.7, 0.8] and [-0.3]
    returns = torch.tensor([0.7, 0.8, -0.3])
    w = (returns - returns.mean()) / returns.std()
    close(a[0], w[:2].tolist())
    close(a[1], w[2:].tolist())


def test_reinforce_pp_without_kl_gives_each_token_its_sequence_reward() -> None:
    algo = AlgoConfig(adv_eps=0.0)
    a = ADVANTAGES.get("reinforce_pp")(torch.tensor([1.0, 0.0, 0.0]), 1, algo, lengths=[2, 1, 0])
    tokens = torch.tensor([1.0, 1.0, 0.0])  # the empty response adds no token to the statistics
    w = (tokens - tokens.mean()) / tokens.std()
    close(a[0], w[:2].tolist())
    close(a[1], w[2:].tolist())
    assert a[2].numel() == 0


def test_reinforce_pp_baseline_subtracts_the_group_mean_first() -> None:
    algo = AlgoConfig(adv_eps=0.0)
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    a = ADVANTAGES.get("reinforce_pp_baseline")(r, 2, algo, lengths=[1, 1, 1, 1])
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0])
    close(torch.cat(a), ((centred - centred.mean()) / centred.std()).tolist())


def test_sequence_estimators_take_the_summed_kl_out_of_the_reward() -> None:
    algo = AlgoConfig(kl_coef=0.5)
    kl = [torch.tensor([0.2, 0.2]), torch.tensor([0.0])]
    a = ADVANTAGES.get("dr_grpo")(torch.tensor([1.0, 1.0]), 2, algo, lengths=[2, 1], kl=kl)
    close(a, [-0.1, 0.1])  # shaped rewards 0.8 and 1.0, mean 0.9


def test_zero_variance_groups() -> None:
    flags = adv.zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    assert flags.tolist() == [True, False, True]


def test_overlong_penalty_is_linear_over_the_buffer() -> None:
    lengths = torch.tensor([0, 12, 13, 14, 16, 20])
    # max 16, buffer 4: free up to 12 tokens, then -(len - 12)/4, -1 at 16 and beyond
    close(adv.overlong_penalty(lengths, 16, 4, 1.0), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(adv.overlong_penalty(lengths, 16, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    close(adv.overlong_penalty(lengths, 16, 0), [0.0] * 6)


def test_truncated_means_the_longest_length_without_eos() -> None:
    lengths = torch.tensor([4, 4, 3, 0])
    eos = torch.tensor([False, True, False, False])
    # 4 tokens without EOS ran out; 4 ending in EOS stopped on the last allowed token; 3 stopped early
    assert adv.truncated(lengths, eos, 4).tolist() == [True, False, False, False]


def test_response_loss_mask_reads_eos_off_the_response() -> None:
    eos = 9
    close(adv.response_loss_mask(torch.tensor([3, 4, 5]), eos, 3), [0.0, 0.0, 0.0])  # ran out of tokens
    close(adv.response_loss_mask(torch.tensor([3, 4, eos]), eos, 3), [1.0, 1.0, 1.0])  # stopped at the limit
    close(adv.response_loss_mask(torch.tensor([3, eos]), eos, 3), [1.0, 1.0])
    assert adv.response_loss_mask(torch.tensor([], dtype=torch.long), eos, 3).numel() == 0


def test_loss_mask_keeps_masked_samples_out_of_the_token_count() -> None:
    """Token-mean over the kept tokens only: the masked sample neither adds to the sum nor to the
    count, so the kept samples' loss is not diluted."""
    algo = AlgoConfig(kl_coef=0.0, loss_agg="token")
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    a = torch.tensor([[2.0, 2.0], [1.0, 1.0], [5.0, 5.0]])
    loss_mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])  # the third sample was truncated
    fields = {"old_logprobs": logp.clone()}
    loss, stats = PolicyObjective(algo)(LossInput(logp, mask, a, fields | {"loss_mask": loss_mask}))
    # ratio 1: per-token loss -A; kept tokens -2, -2, -1 -> mean -5/3 (the truncated 5s do not count)
    close(loss, -5.0 / 3.0)
    assert stats["loss_masked_frac"] == pytest.approx(2 / 5)  # 2 of the 5 response tokens
    unmasked, _ = PolicyObjective(algo)(LossInput(logp, mask, a, fields))
    close(unmasked, -(2 + 2 + 1 + 5 + 5) / 5.0)


# ---------------------------------------------------------------- losses


def test_seq_sum_divides_token_sums_by_a_constant() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # (1 + 2 + 4) / (norm 4 * 2 sequences)
    close(core.aggregate(per_token, mask, "seq_sum", 4.0), 7 / 8)
    close(AGGREGATIONS.get("seq_sum")(per_token, mask, AlgoConfig(max_new_tokens=4)), 7 / 8)
    with pytest.raises(ValueError, match="positive constant"):
        core.aggregate(per_token, mask, "seq_sum")


def test_gspo_ratio_is_the_length_normalised_sequence_ratio() -> None:
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -2.4, 0.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([1.0, -1.0])
    loss, stats = core.gspo_loss(logp, old, advantages, mask, clip_low=0.5, clip_high=0.5, agg="seq")
    s0 = math.exp((0.2 + 0.4) / 2)  # exp(mean log-ratio over the 2 valid tokens), masked token ignored
    # loss = mean over sequences of -A * s (no clip at 0.5): (-s0 + 1) / 2
    close(loss, (-s0 + 1.0) / 2)
    close(stats.ratio_mean, (2 * s0 + 3 * 1.0) / 5)
    loss.backward()
    # d/dlogp_t of -A * s / |y| averaged over 2 sequences: row 0: -s0 / 2 / 2 per valid token
    assert logp.grad is not None
    close(logp.grad[0], [-s0 / 4, -s0 / 4, 0.0])
    close(logp.grad[1], [1 / 6, 1 / 6, 1 / 6])


def test_gspo_clips_whole_sequences() -> None:
    logp = torch.tensor([[0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.01, 0.01], [-0.02, -0.02]])  # ratios exp(0) = 1 and exp(0.02)
    mask = torch.ones(2, 2)
    loss, stats = core.gspo_loss(logp, old, torch.tensor([1.0, 1.0]), mask, clip_low=3e-4, clip_high=4e-4)
    close(stats.clip_frac_high, 0.5)  # the second sequence, both its tokens
    loss.backward()
    assert logp.grad is not None
    close(logp.grad[1], [0.0, 0.0])
    close(logp.grad[0], [-0.25, -0.25])


def test_gspo_equals_ppo_clip_for_one_token_responses() -> None:
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(6, 1, generator=g), torch.randn(6, 1, generator=g) * 0.1
    mask, a = torch.ones(6, 1), torch.randn(6, generator=g)
    gspo, _ = core.gspo_loss(logp + old, old, a, mask, 0.2, 0.28, "token")
    ppo, _ = core.ppo_clip_loss(logp + old, old, a, mask, 0.2, 0.28, "token")
    close(gspo, ppo.item())


def test_objective_uses_the_registered_loss_and_aggregation() -> None:
    algo = AlgoConfig(policy_loss="gspo", loss_agg="seq_sum", max_new_tokens=4, kl_coef=0.0, clip_low=0.1,
                      clip_high=0.1)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    old = logp - 0.01
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    a = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    loss, stats = PolicyObjective(algo)(LossInput(logp, mask, a, {"old_logprobs": old}))
    expected, _ = POLICY_LOSSES.get("gspo")(logp, old, a, mask, algo, lambda v, m: core.aggregate(v, m, "seq_sum", 4.0))
    close(loss, expected.item())
    assert {"clip_frac_low", "clip_frac_high"} <= set(stats)


def test_objective_with_a_kl_term_refuses_a_batch_without_reference_logprobs() -> None:
    """The KL is part of the loss whenever kl_coef > 0: a batch that lost its reference log-probs
    is an error, never a step trained without the KL; with them, the KL term is in the loss."""
    algo = AlgoConfig(kl_coef=0.5, max_new_tokens=2)
    logp = torch.tensor([[-1.0, -2.0]])
    x = LossInput(logp, torch.ones(1, 2), torch.ones(1, 2), {"old_logprobs": logp})
    with pytest.raises(ValueError, match=r"kl_coef=0.5 .* no reference log-probs"):
        PolicyObjective(algo)(x)
    x.fields["ref_logprobs"] = logp - 1.0
    loss, stats = PolicyObjective(algo)(x)
    without, _ = PolicyObjective(AlgoConfig(kl_coef=0.0, max_new_tokens=2))(x)
    assert stats["kl_ref"] > 0 and loss.item() == pytest.approx(without.item() + 0.5 * stats["kl_ref"], rel=1e-6)


# ---------------------------------------------------------------- dynamic sampling


def test_group_picker_prefers_varied_groups_and_fills_at_the_cap() -> None:
    p = GroupPicker(wanted=3)
    p.add_round(0, [True, False, True])
    assert not p.full
    p.add_round(3, [False, True, False])
    assert p.full and p.picked() == [1, 3, 5]
    short = GroupPicker(wanted=3)
    short.add_round(0, [True, False, True])
    short.add_round(3, [True, True, True])
    assert short.picked() == [0, 1, 2]  # one varied group, filled with the first flat ones
    assert short.stats() == {"sampling/rounds": 2.0, "sampling/groups_generated": 6.0,
                             "sampling/zero_variance_frac": 5 / 6, "sampling/zero_variance_in_batch": 2.0}


def test_select_keeps_the_picked_groups_and_names_the_rest() -> None:
    def ro(first: int) -> Rollouts:
        ids = list(range(first, first + 4))
        return Rollouts(ids, [str(i // 2) for i in ids], 2, {i: 3 for i in ids}, {i: 1 + i % 2 for i in ids})

    parts = [(ro(0), torch.tensor([0.0, 0.0, 1.0, 0.0])), (ro(10), torch.tensor([1.0, 0.0, 1.0, 1.0]))]
    kept, rewards, dropped = select(parts, [1, 2])
    assert kept.ids == [2, 3, 10, 11] and rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert kept.answers == ["1", "1", "5", "5"] and set(kept.response_len) == set(kept.ids)
    assert dropped == [0, 1, 12, 13]


def test_entropy_is_a_metric_every_step_without_changing_the_loss() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=g)
    chunked = core.entropy_for_stats(logits, rows=5)  # 12 positions in chunks of 5, 5 and 2
    assert torch.allclose(chunked, core.entropy_from_logits(logits), atol=1e-6)
    logp = torch.log_softmax(logits, -1)[..., 0].clone().requires_grad_()
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    algo = AlgoConfig(entropy_coef=0.0, kl_coef=0.0)
    a = torch.ones(3, 4)
    with_logits, stats = PolicyObjective(algo)(LossInput(logp, mask, a, {}, logits))
    without, plain = PolicyObjective(algo)(LossInput(logp, mask, a, {}))
    assert with_logits.item() == without.item() and "entropy" not in plain
    want = (core.entropy_from_logits(logits) * mask).sum() / mask.sum()
    assert abs(stats["entropy"] - want.item()) < 1e-6
