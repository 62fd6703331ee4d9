"""The planner's model of partial rollouts with in-flight weight updates (``rlbatch.plan.inflight``):
the step is max(the generation of a batch without its longest samples, the rest) + sync, its two
limits (generation-bound, train-bound), and ``predict`` on a disaggregated vLLM placement, where
the long tail of responses no longer sets the generation's time."""

from __future__ import annotations

from typing import Any

import pytest

from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import shape_from_config
from rlbatch.plan.inflight import step_time, tail_free
from rlbatch.plan.predict import Prediction, predict
from tests.unit.planner.conftest import make_config, make_layout, roles, workload_of


def test_the_step_is_the_longer_side_plus_the_sync() -> None:
    assert step_time(generate_s=5.0, rest_s=2.0, sync_s=0.5) == 5.5  # generation-bound
    assert step_time(generate_s=1.0, rest_s=4.0, sync_s=0.5) == 4.5  # train-bound: the generation is hidden
    assert step_time(generate_s=3.0, rest_s=3.0, sync_s=0.0) == 3.0
    with pytest.raises(ValueError, match="negative phase time"):
        step_time(-1.0, 1.0, 0.0)


def test_a_tail_free_batch_decodes_the_mean_length_with_the_batch_full() -> None:
    w = _workload(_config(partial=True, max_new_tokens=256, response_mean=0.1))
    assert w.response_max == 256 and w.survival()[-1] < 0.05  # a long tail: few samples reach the cap
    t = tail_free(w)
    assert t.response_max == 26 and t.response_mean == w.response_mean
    assert t.survival().sum() == pytest.approx(w.survival().sum(), rel=1e-3)  # the same tokens
    assert t.survival().min() > 0.05  # in about a tenth of the steps, the batch nearly full throughout


def _config(partial: bool, max_new_tokens: int = 256, response_mean: float = 0.1, **algo: Any) -> dict[str, Any]:
    cfg = make_config(roles=roles("fsdp:d1", "vllm:d1", [0], [1]))
    cfg["algo"].update({"max_staleness": 2, "in_flight_updates": True, "partial_rollouts": partial,
                        "off_policy": "tis", "max_new_tokens": max_new_tokens, **algo})
    cfg["_response_mean"] = response_mean
    return cfg


def _workload(cfg: dict[str, Any]) -> Any:
    return workload_of({k: v for k, v in cfg.items() if k != "_response_mean"}, response_mean=cfg["_response_mean"])


def _predict(cfg: dict[str, Any], hardware: str = "cpu") -> Prediction:
    return predict(make_layout(cfg), shape_from_config(cfg["model"]), _workload(cfg), load_hardware(hardware))


def _phases(p: Prediction) -> dict[str, Any]:
    return {t.name: t for t in p.phases}


def test_partial_rollouts_predict_the_generation_without_its_tail_and_the_step_from_it() -> None:
    """Generation-bound (an H100, a long tail: responses average a tenth of 1024 tokens): with
    partial rollouts the generation is that of a batch at the mean length, shorter than one waiting
    for its longest sample, the step is max(generation, rest) + sync, and it is shorter than
    without them, whose step is the generation's plus the sync."""
    part, whole = (_predict(_config(partial=p, max_new_tokens=1024), "h100_sxm") for p in (True, False))
    g, g0 = _phases(part)["generate"], _phases(whole)["generate"]
    assert g.total_s < 0.8 * g0.total_s, (g.total_s, g0.total_s)
    ph = _phases(part)
    rest = max(t.end for t in part.phases if t.kind not in ("generate", "sync"))
    fixed = part.step_s - ph["sync"].end
    assert part.step_s == pytest.approx(step_time(g.end, rest, ph["sync"].total_s) + fixed)
    w = _phases(whole)
    assert whole.step_s == pytest.approx(w["generate"].end + w["sync"].total_s + fixed)  # generation-bound
    assert part.step_s < 0.5 * whole.step_s, (part.step_s, whole.step_s)
    assert any("partial rollouts: the generation of a batch without its longest samples" in n for n in part.notes)
    # without in-flight updates the option does nothing (it is refused before a run starts)
    assert not _workload(_config(partial=True, in_flight_updates=False)).partial_rollouts


def test_train_bound_the_tail_is_hidden_either_way() -> None:
    """Train-bound (the CPU profile, where a training token costs more than a decoded one): the
    generation, with its tail or not, runs beside the trainer's phases, and the step is theirs plus
    the sync either way."""
    part, whole = (_predict(_config(partial=p)) for p in (True, False))
    assert _phases(part)["generate"].total_s < _phases(whole)["generate"].total_s
    ph = _phases(part)
    rest = max(t.end for t in part.phases if t.kind not in ("generate", "sync"))
    assert ph["generate"].end < rest and ph["sync"].start == pytest.approx(rest)
    assert part.step_s == pytest.approx(whole.step_s)


def test_without_a_tail_partial_rollouts_change_nothing() -> None:
    """Every response at the cap: the tail-free batch is the batch."""
    part, whole = (_predict(_config(partial=p, max_new_tokens=8, response_mean=1.0), "h100_sxm") for p in (True, False))
    assert _phases(part)["generate"].total_s == pytest.approx(_phases(whole)["generate"].total_s)
    assert part.step_s == pytest.approx(whole.step_s)
