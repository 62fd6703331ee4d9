"""The checked sync's comparison (``rlbatch.loop.synccheck``): the statistic, the tolerance, when a
sync is checked, the error's words; the ``drop`` fault's sink; the baseline in a checkpoint; the
config field's range. The run that stops on a broken sync: tests/dist/test_synccheck.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlbatch.engines.registry import spec_of
from rlbatch.loop.synccheck import FACTOR, SyncCheck, due, failure, mismatch, tolerance
from rlbatch.runtime.faults import DropFirst
from tests.unit.configs import default_config, problems, set_


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_the_statistic_is_the_worst_workers_mean_absolute_difference() -> None:
    healthy = [(t(-1.0, -2.0), t(-1.0, -2.0 + 1e-6))]
    broken = [(t(-1.0, -2.0, -3.0), t(-1.1, -2.0, -3.2)), (t(-0.5,), t(-0.5,))]
    m = mismatch([healthy, broken])
    assert m.worker == 1 and m.tokens == 4 and m.total_tokens == 6
    assert m.worst == pytest.approx((0.1 + 0.0 + 0.2 + 0.0) / 4, rel=1e-5)
    assert m.max_abs == pytest.approx(0.2, rel=1e-5)
    # the same tokens scored alike: nothing
    assert mismatch([[(t(-1.0, -3.0), t(-1.0, -3.0))]]).worst == 0.0


def test_a_non_finite_log_prob_is_the_worst_mismatch_and_other_lengths_are_refused() -> None:
    m = mismatch([[(t(-1.0), t(-1.0))], [(t(-1.0, float("nan")), t(-1.0, -2.0))]])
    assert m.worker == 1 and math.isinf(m.worst) and not m.worst <= 1e9
    with pytest.raises(ValueError, match="probe sample 0 of inference worker 0: 2 behaviour log-probs, 3 from"):
        mismatch([[(t(-1.0, -2.0), t(-1.0, -2.0, -3.0))]])
    assert mismatch([[(t(), t())]]).worst == 0.0  # a probe that ended at once matches


def test_the_tolerance_is_a_multiple_of_the_baseline_never_under_the_engines_floor() -> None:
    assert tolerance(None, 1e-4) == 1e-4
    assert tolerance(1e-7, 1e-4) == 1e-4
    assert tolerance(1e-2, 1e-4) == pytest.approx(FACTOR * 1e-2)
    # the motivating case: a tied weight left behind gave 0.002 after one step, fp32 on CPU
    assert 2e-3 > tolerance(6e-7, spec_of("hf").sync_check_floor)
    assert spec_of("vllm").sync_check_floor >= spec_of("hf").sync_check_floor


def test_the_first_sync_and_every_nth_version_are_checked_none_with_zero() -> None:
    assert [v for v in range(1, 12) if due(v, 5, first=v == 1)] == [1, 5, 10]
    assert due(7, 5, first=True)  # a resumed run's first sync
    assert not any(due(v, 0, first=True) for v in range(1, 5))


def test_the_error_names_the_role_the_step_and_the_numbers() -> None:
    m = mismatch([[(t(-1.0), t(-1.0))], [(t(-1.0, -2.0), t(-1.0, -2.05))]])
    text = failure(m, 1e-4, "the hf engine's floor", step=3, version=4, infer="actor_infer", train="actor_train",
                   workers=[(1,), (2,)])
    assert text.startswith("weight sync check failed after step 3 (policy version 4): actor_infer computes")
    assert "mean |log-prob difference| 0.025 on actor_infer worker 1 (ranks 2) over 2 probe tokens" in text
    assert "tolerance 0.0001 (the hf engine's floor)" in text and "cluster.sync_check_every=0" in text


def test_the_drop_fault_leaves_the_first_tensor_of_a_sync_unloaded() -> None:
    class Engine:
        def __init__(self) -> None:
            self.loaded: list[str] = []

        def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
            self.loaded += [n for n, _ in named]
            return sum(x.numel() for _, x in named)

        def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
            return torch.zeros(4)

    engine = Engine()
    sink = DropFirst(engine)
    assert sink.weight_views(["a"], torch.float32) is None  # every bucket through load_weights
    assert sink.load_weights([("a", torch.ones(2)), ("b", torch.ones(3))]) == 3
    assert sink.load_weights([("c", torch.ones(1))]) == 1
    assert engine.loaded == ["b", "c"] and sink.dropped == "a"


def test_the_baseline_travels_in_checkpoints(tmp_path: Path) -> None:
    check = SyncCheck.__new__(SyncCheck)  # the part alone: no pipeline
    check.baseline = None
    assert check.save(tmp_path) == {} and not list(tmp_path.iterdir())  # nothing measured, nothing kept
    check.baseline = 3.5e-7
    check.save(tmp_path)
    other = SyncCheck.__new__(SyncCheck)
    other.baseline = None
    other.load(tmp_path, {})
    assert other.baseline == 3.5e-7


def test_the_cadence_is_a_non_negative_count(tmp_path: Path) -> None:
    found = problems(set_(default_config(tmp_path), cluster__sync_check_every=-1), runnable=False)
    assert any("cluster.sync_check_every" in p and "-1" in p for p in found), found
