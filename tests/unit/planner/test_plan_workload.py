"""The step's workload: defaults, measured tokens, and the long-tail response distribution."""

from __future__ import annotations

import pytest
from conftest import make_config, make_layout, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import shape_from_config
from rlbatch.plan.predict import predict
from rlbatch.plan.workload import SYNTHETIC_PROMPT_LEN, expected_rounds


def test_defaults_of_the_default_experiment() -> None:
    w = workload_of(make_config())
    assert w.sequences == 16 * 8 and w.prompt_len == SYNTHETIC_PROMPT_LEN and w.response_max == 8
    assert w.kl and not w.critic and not w.prompt_len_assumed and w.response_assumed


@pytest.mark.parametrize(("mean", "cap"), [(2, 8), (4.8, 8), (8, 8), (300, 2048), (2000, 2048)])
def test_survival_has_the_requested_mean_and_reaches_the_cap(mean: float, cap: int) -> None:
    w = workload_of(make_config(algo={"max_new_tokens": cap}), response_mean=mean)
    s = w.survival()
    assert len(s) == cap and s[0] == pytest.approx(1.0) and s[-1] > 0
    assert s.sum() == pytest.approx(mean, rel=1e-6)
    assert all(a >= b for a, b in zip(s, s[1:], strict=False))


def test_measured_tokens_replace_the_assumptions() -> None:
    w = workload_of(make_config(data={"name": "file", "path": "x.jsonl"}))
    assert w.prompt_len_assumed
    m = w.with_measured(generated=128 * 3.0, total=128 * 10.0, response_max=6)
    assert (m.response_mean, m.prompt_len, m.response_max) == (3.0, 7.0, 6)
    assert not m.prompt_len_assumed and not m.response_assumed


def test_expected_rounds_by_hand() -> None:
    # 1 group a round, useful with q = 1/2, cap 3: round 1 always; round 2 when the first was
    # flat (1/2); round 3 when both were (1/4): 1 + 1/2 + 1/4
    assert expected_rounds(1, 0.5, 3) == pytest.approx(1.75)
    # 2 groups, q = 1/2, cap 2: round 2 unless both of round 1's are useful (1 - 1/4)
    assert expected_rounds(2, 0.5, 2) == pytest.approx(1.75)
    # 2 groups, q = 1/2, cap 3: + P(fewer than 2 useful of 4) = (1 + 4) / 16
    assert expected_rounds(2, 0.5, 3) == pytest.approx(1.75 + 5 / 16)
    assert expected_rounds(32, 0.0, 3) == 1.0 and expected_rounds(32, 1.0, 3) == 3.0
    # many groups: the binomial concentrates, ceil(1 / q) rounds (2 at q = 0.6, 3 at q = 0.4)
    assert expected_rounds(1024, 0.4, 5) == pytest.approx(2.0, abs=1e-6)
    assert expected_rounds(1024, 0.6, 5) == pytest.approx(3.0, abs=1e-6)
    with pytest.raises(ValueError, match="in \\[0, 1\\], got 1.5"):
        expected_rounds(4, 1.5, 3)


def test_dynamic_sampling_sets_the_rounds_from_the_assumed_fraction() -> None:
    plain = make_config(algo={"dynamic_sampling": True, "prompts_per_step": 2, "max_sampling_rounds": 3})
    assert workload_of(plain).generation_rounds == pytest.approx(1.75 + 5 / 16)  # default 0.5
    assert workload_of(plain, zero_variance_frac=0.0).generation_rounds == 1.0
    assert workload_of(make_config()).generation_rounds == 1.0  # no dynamic sampling
    measured = workload_of(plain).with_measured(None, None, None, rounds=2.0)
    assert measured.generation_rounds == 2.0


def test_the_rounds_multiply_generate_and_score_only() -> None:
    hw = load_hardware("h100_sxm")
    out = {}
    for dynamic in (False, True):
        cfg = make_config(algo={"dynamic_sampling": dynamic, "prompts_per_step": 2, "max_sampling_rounds": 3})
        w = workload_of(cfg)
        out[dynamic] = predict(make_layout(cfg), shape_from_config(cfg["model"]), w, hw)
    rounds = 1.75 + 5 / 16
    for name in ("generate", "score"):
        assert out[True].phase(name).seconds == pytest.approx(rounds * out[False].phase(name).seconds)
    for name in ("ref_logprobs", "train", "sync"):
        assert out[True].phase(name).seconds == pytest.approx(out[False].phase(name).seconds)
    assert out[True].step_s > out[False].step_s
    # each round is scored before the batch goes on: the log-prob phases start after the score
    assert out[True].phase("ref_logprobs").start >= out[True].phase("score").end
    assert out[False].phase("ref_logprobs").start < out[False].phase("score").end
    assert any("2.06 expected generate+score rounds" in n and "0.5" in n for n in out[True].notes)
