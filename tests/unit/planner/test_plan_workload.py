"""The step's workload: defaults, measured tokens, and the long-tail response distribution."""

from __future__ import annotations

import pytest
from conftest import make_config

from rlbatch.plan.workload import SYNTHETIC_PROMPT_LEN, workload_from_config


def test_defaults_of_the_default_experiment() -> None:
    w = workload_from_config(make_config())
    assert w.sequences == 16 * 8 and w.prompt_len == SYNTHETIC_PROMPT_LEN and w.response_max == 8
    assert w.kl and not w.critic and not w.prompt_len_assumed and w.response_assumed


@pytest.mark.parametrize(("mean", "cap"), [(2, 8), (4.8, 8), (8, 8), (300, 2048), (2000, 2048)])
def test_survival_has_the_requested_mean_and_reaches_the_cap(mean: float, cap: int) -> None:
    w = workload_from_config(make_config(algo={"max_new_tokens": cap}), response_mean=mean)
    s = w.survival()
    assert len(s) == cap and s[0] == pytest.approx(1.0) and s[-1] > 0
    assert s.sum() == pytest.approx(mean, rel=1e-6)
    assert all(a >= b for a, b in zip(s, s[1:], strict=False))


def test_measured_tokens_replace_the_assumptions() -> None:
    w = workload_from_config(make_config(data={"name": "file", "path": "x.jsonl"}))
    assert w.prompt_len_assumed
    m = w.with_measured(generated=128 * 3.0, total=128 * 10.0, response_max=6)
    assert (m.response_mean, m.prompt_len, m.response_max) == (3.0, 7.0, 6)
    assert not m.prompt_len_assumed and not m.response_assumed
