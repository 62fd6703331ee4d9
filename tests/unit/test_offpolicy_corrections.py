"""Off-policy corrections per token and per sequence: each token's importance weight is taken
from its own behaviour log-prob (checked by hand against the loss's gradient, through the
trainer's packing of ragged samples), the sequence-level variants on the geometric-mean ratio,
and the train/inference mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch

from rlbatch.algos.objective import LossInput, PolicyObjective
from rlbatch.algos.offpolicy import importance_ratio, ratio_stats, sequence_ratio
from rlbatch.algos.registry import OFF_POLICY, SEQUENCE_CORRECTIONS
from rlbatch.config.schema import AlgoConfig
from rlbatch.engines.batch import pack


def _samples() -> list[dict[str, torch.Tensor]]:
    """Three ragged samples whose behaviour log-probs differ token by token (as when weights land
    mid-generation): every token its own ratio, some above the caps, some below the mask."""
    g = torch.Generator().manual_seed(3)
    out = []
    for r in (5, 2, 7):
        old = -torch.rand(r, generator=g) * 2
        behaviour = old - torch.randn(r, generator=g)  # log-ratios ~ N(0, 1): ratios from ~0.1 to ~10
        out.append({"prompt": torch.tensor([1, 2]), "response": torch.arange(r) % 5, "old_logprobs": old,
                    "behaviour_logprobs": behaviour, "advantage": torch.tensor(1.0 + len(out))})
    return out


def _weights_from_the_loss(samples: list[dict[str, torch.Tensor]], algo: AlgoConfig) -> list[list[float]]:
    """Each response token's weight as the loss applies it: at logp = old (the first update) the
    PPO-clip loss with token aggregation is -sum_t A_t w_t k_t / sum_t k_t (k the keep mask), so
    d loss / d logp_t = -A_t w_t / N on kept tokens and 0 on the others."""
    packed = pack(samples, pad_id=0, device=torch.device("cpu"))
    logp = packed.fields["old_logprobs"].clone().requires_grad_(True)
    objective = PolicyObjective(algo)
    loss, _ = objective(LossInput(logp, packed.mask, packed.token_advantages(), dict(packed.fields)))
    loss.backward()
    assert logp.grad is not None
    kept = sum(float(objective.token_mask(s).sum()) for s in samples)
    per_token = -logp.grad * kept / packed.token_advantages()
    return [per_token[b, :n].tolist() for b, n in enumerate(packed.lengths)]


def _by_hand(samples: list[dict[str, torch.Tensor]]) -> list[list[float]]:
    return [[math.exp(float(o) - float(b)) for o, b in zip(s["old_logprobs"], s["behaviour_logprobs"], strict=True)]
            for s in samples]


def test_tis_and_mask_weigh_each_token_by_its_own_behaviour_logprob() -> None:
    samples, algo = _samples(), AlgoConfig(kl_coef=0.0, entropy_coef=0.0, off_policy="tis", tis_cap=2.0)
    ratios = _by_hand(samples)
    got = _weights_from_the_loss(samples, algo)
    want = [[min(r, 2.0) for r in row] for row in ratios]
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-5)
    assert len({round(x, 4) for row in want for x in row}) > 5, "the tokens' weights differ one from another"

    algo = AlgoConfig(kl_coef=0.0, entropy_coef=0.0, off_policy="mask", mask_ratio_low=0.5, mask_ratio_high=2.0)
    got = _weights_from_the_loss(samples, algo)
    want = [[1.0 if 0.5 <= r <= 2.0 else 0.0 for r in row] for row in ratios]
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-5)
    assert 0 < sum(map(sum, want)) < sum(map(len, want)), "some tokens are masked, some kept"


def test_sequence_corrections_weigh_or_drop_whole_sequences_by_their_geometric_mean_ratio() -> None:
    samples = _samples()
    geo = [math.exp(sum(math.log(r) for r in row) / len(row)) for row in _by_hand(samples)]
    cap = sorted(geo)[1]  # one sequence above the cap, the others below or at it
    got = _weights_from_the_loss(samples, AlgoConfig(kl_coef=0.0, entropy_coef=0.0, off_policy="seq_tis",
                                                     seq_tis_cap=cap))
    for g, s, n in zip(got, geo, (5, 2, 7), strict=True):
        assert g == pytest.approx([min(s, cap)] * n, rel=1e-5)

    low, high = sorted(geo)[0] + 1e-3, 1.0 + max(geo)  # the sequence of the lowest ratio leaves, the others stay
    algo = AlgoConfig(kl_coef=0.0, entropy_coef=0.0, off_policy="seq_mask", seq_mask_low=min(low, 1.0), seq_mask_high=high)
    if low > 1.0:
        pytest.fail(f"the samples' lowest geometric-mean ratio {min(geo)} should be below 1")
    got = _weights_from_the_loss(samples, algo)
    for g, s, n in zip(got, geo, (5, 2, 7), strict=True):
        assert g == pytest.approx([1.0 if s >= low else 0.0] * n, abs=1e-5)
    assert {"seq_tis", "seq_mask"} <= SEQUENCE_CORRECTIONS and {"seq_tis", "seq_mask", "tis", "mask"} <= set(OFF_POLICY.names())


def test_a_sequence_ratio_reads_only_the_tokens_in_the_loss() -> None:
    ratio = torch.tensor([[2.0, 8.0, 100.0], [0.5, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert sequence_ratio(ratio, mask).flatten().tolist() == pytest.approx([4.0, 1.0])


def test_the_mismatch_metrics_by_hand() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -1.0, -2.0, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    ratio = importance_ratio(old, behaviour)
    r = [1.0, math.exp(-1.0), math.exp(1.5), math.exp(0.5)]
    stats = ratio_stats(ratio, ratio.clamp(max=2.0), torch.ones_like(ratio), mask)
    assert stats["offpolicy/k3_kl"] == pytest.approx(sum(x - math.log(x) - 1 for x in r) / 4, rel=1e-5)
    assert stats["offpolicy/ratio_p50"] == pytest.approx(float(torch.quantile(torch.tensor(r), 0.5)), rel=1e-5)
    assert stats["offpolicy/ratio_p05"] < stats["offpolicy/ratio_p50"] < stats["offpolicy/ratio_p95"]
    assert stats["offpolicy/ratio_p95"] == pytest.approx(float(torch.quantile(torch.tensor(r), 0.95)), rel=1e-5)
    assert stats["offpolicy/truncated_frac"] == pytest.approx(1 / 4)
    assert stats["offpolicy/masked_frac"] == 0.0
    # a sequence-level correction counts a token truncated against its sequence's ratio
    geo = math.exp(sum(math.log(x) for x in r) / 4)
    seq = ratio_stats(ratio, torch.full_like(ratio, min(geo, 1.0)), torch.ones_like(ratio), mask, sequence=True)
    assert seq["offpolicy/truncated_frac"] == (1.0 if geo > 1.0 else 0.0)


def test_the_sequence_corrections_bounds_are_validated(tmp_path: object) -> None:
    import dataclasses

    from rlbatch.config.schema import RLBatchConfig
    from tests.unit.configs import problems

    c = dataclasses.asdict(RLBatchConfig())
    c["run_dir"] = str(tmp_path)
    c["algo"].update(off_policy="seq_mask", seq_mask_low=1.2, seq_mask_high=0.9, seq_tis_cap=0.5)
    assert problems(c) == ["algo.seq_tis_cap: must be >= 1, got 0.5", "algo.seq_mask_low: must be in (0, 1], got 1.2",
                           "algo.seq_mask_high: must be >= 1, got 0.9"]
