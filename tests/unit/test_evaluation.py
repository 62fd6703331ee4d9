"""Held-out evaluation's arithmetic and configuration: the unbiased pass@k, the per-source metrics,
the schedule, and the eval section's refusals (rlbatch.loop.evaluation, rlbatch.checks.eval_rules)."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.loop.evaluation import due, eval_metrics, eval_seed, ks_of, pass_at_k
from tests.unit.configs import problems, set_


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """pass@k by its definition: the share of the k-subsets of n samples (c correct) holding a correct one."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(100, 1, 100) == 1.0 and pass_at_k(100, 0, 100) == 0.0
    assert 0.0 < pass_at_k(200, 1, 10) < 1.0  # large n: the product form, no overflow


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def test_the_ks_reported_are_one_the_powers_of_two_below_n_and_n() -> None:
    assert ks_of(1) == [1]
    assert ks_of(2) == [1, 2]
    assert ks_of(5) == [1, 2, 4, 5]
    assert ks_of(8) == [1, 2, 4, 8]


def test_metrics_per_data_source_and_over_all() -> None:
    # three prompts of two samples: gsm8k (1 of 2 correct), math (2 of 2; the second at exactly
    # correct_at), gsm8k (0 of 2, one with partial credit)
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5]
    sources = ["gsm8k", "gsm8k", "math", "math", "gsm8k", "gsm8k"]
    lengths = [4, 6, 10, 20, 1, 3]
    out = eval_metrics(rewards, sources, lengths, n=2, correct_at=1.0)
    assert out["eval/gsm8k/mean_reward"] == pytest.approx(1.5 / 4)
    assert out["eval/gsm8k/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["eval/gsm8k/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["eval/gsm8k/response_len_mean"] == pytest.approx(14 / 4)
    assert out["eval/gsm8k/prompts"] == 2
    assert out["eval/math/pass@1"] == 1.0 and out["eval/math/pass@2"] == 1.0 and out["eval/math/prompts"] == 1
    assert out["eval/all/mean_reward"] == pytest.approx(3.5 / 6)
    assert out["eval/all/pass@1"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert out["eval/all/pass@2"] == pytest.approx((1.0 + 1.0 + 0.0) / 3)
    assert out["eval/all/response_len_mean"] == pytest.approx(44 / 6)
    # a lower bar counts the partial credit as correct
    assert eval_metrics(rewards, sources, lengths, n=2, correct_at=0.5)["eval/gsm8k/pass@1"] == pytest.approx(0.5)


def test_samples_without_a_source_count_in_all_only() -> None:
    out = eval_metrics([1.0, 0.0, 0.0], ["", "", ""], [1, 1, 1], n=1, correct_at=1.0)
    assert {k.split("/")[1] for k in out} == {"all"}
    assert out["eval/all/pass@1"] == pytest.approx(1 / 3) and "eval/all/pass@2" not in out


def test_metrics_refuse_samples_that_do_not_make_groups() -> None:
    with pytest.raises(ValueError, match="5 rewards.*n=2"):
        eval_metrics([0.0] * 5, [""] * 5, [1] * 5, n=2, correct_at=1.0)


def test_the_schedule_evaluates_every_nth_step_and_the_last() -> None:
    assert [s for s in range(7) if due(s, 7, 3, at_start=False)] == [2, 5, 6]
    assert [s for s in range(6) if due(s, 6, 3, at_start=False)] == [2, 5]
    assert [s for s in range(4) if due(s, 4, 1, at_start=False)] == [0, 1, 2, 3]
    # step 0's row holds the initial weights' evaluation with at_start
    assert [s for s in range(4) if due(s, 4, 1, at_start=True)] == [1, 2, 3]
    assert not any(due(s, 5, 0, at_start=True) for s in range(5))


def test_the_eval_seed_depends_on_the_run_seed_and_the_version_only() -> None:
    assert eval_seed(1, 4) == eval_seed(1, 4)
    assert len({eval_seed(s, u) for s in range(5) for u in range(5)}) == 25
    assert all(0 <= eval_seed(s, u) < 2**31 for s in (0, 2**32 - 1) for u in (0, 10**9))


# ------------------------------------------------------------------------------- configuration
def test_evaluation_of_the_default_experiment_is_runnable(cfg: dict[str, Any]) -> None:
    check(set_(cfg, eval__every=5, eval__at_start=True, eval__samples_per_prompt=4, eval__temperature=0.7))


@pytest.mark.parametrize("field, value, expected", [
    ("every", -1, "eval.every: must be >= 0"),
    ("samples_per_prompt", 0, "eval.samples_per_prompt: must be >= 1"),
    ("temperature", -0.5, "eval.temperature: must be >= 0"),
    ("max_prompts", 1.5, "eval.max_prompts"),
    ("correct_at", 0.0, "eval.correct_at: must be > 0"),
    ("at_start", "yes", "eval.at_start: expected true or false"),
])
def test_eval_fields_out_of_range_are_named(cfg: dict[str, Any], field: str, value: Any, expected: str) -> None:
    found = problems(set_(cfg, **{f"eval__{field}": value}), runnable=False)
    assert any(p.startswith(expected) and str(value) in p for p in found), found


def test_unknown_eval_fields_and_names_are_refused(cfg: dict[str, Any]) -> None:
    found = problems(set_(cfg, eval__freq=3, eval__data__shuffle=True, eval__data__name="gsm8k"), runnable=False)
    assert any(p.startswith("eval: unknown field(s) ['freq']") for p in found), found
    assert any(p.startswith("eval.data: unknown field(s) ['shuffle']") for p in found), found
    assert any(p.startswith("eval.data.name: 'gsm8k' is not one of") for p in found), found


def test_k_greedy_samples_are_refused(cfg: dict[str, Any]) -> None:
    found = problems(set_(cfg, eval__every=2, eval__samples_per_prompt=4))
    assert found == [p for p in found if p.startswith("eval.samples_per_prompt: 4 samples per prompt at "
                                                      "eval.temperature=0")] and len(found) == 1, found
    check(set_(cfg, eval__every=2, eval__samples_per_prompt=4, eval__temperature=0.6))
    check(set_(cfg, eval__samples_per_prompt=4))  # evaluation off: nothing to refuse


def test_eval_data_of_another_kind_or_with_its_own_rewards_is_refused(cfg: dict[str, Any]) -> None:
    found = problems(set_(cfg, eval__at_start=True, eval__data__name="synthetic_code"), runnable=False)
    assert any(p.startswith("eval.data.name: 'synthetic_code' differs from data.name='synthetic'") for p in found), found
    found = problems(set_(cfg, eval__every=1, eval__data__reward_fn="rlbatch.rewards.math:gsm8k_match"))
    assert any(p.startswith("eval.data.reward_fn: 'rlbatch.rewards.math:gsm8k_match' differs from data.reward_fn=")
               for p in found), found
    same = "rlbatch.rewards.math:gsm8k_match"
    check(set_(cfg, eval__every=1, data__reward_fn=same, eval__data__reward_fn=same))


def test_a_held_out_file_is_checked_as_the_training_file_is(cfg: dict[str, Any], tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    base = set_(cfg, data__name="file", data__path=str(train), model__path=str(model), model__check_path=False,
                eval__every=2, eval__data__name="file")
    assert any(p.startswith("eval.data.path: eval.data.name=file needs the held-out") for p in problems(base)), \
        problems(base)
    missing = tmp_path / "data.jsonl"
    found = problems(set_(base, eval__data__path=str(missing)))
    assert found == [f"eval.data.path: {missing} does not exist on this machine; set eval.data.check_path=false if "
                     f"only the compute nodes see it"], found
    held_out = tmp_path / "test.jsonl"
    held_out.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2"}], "reward_model": {"ground_truth": "4"}})
                        + "\n")
    found = problems(set_(base, eval__data__path=str(held_out)))
    assert any(p.startswith(f"eval.data.path: {held_out}: the prompts ('prompt') of 1 of its 1 usable records are chat")
               and "set eval.data.chat_template=true" in p for p in found), found
    found = problems(set_(base, eval__data__path=str(train), eval__data__layout="csv"))
    assert any(p.startswith("eval.data.layout: 'csv' is not one of") for p in found), found
    held_out.write_text(json.dumps({"question": "2+2", "answer": "4"}) + "\n")
    check(set_(base, eval__data__path=str(held_out)))
