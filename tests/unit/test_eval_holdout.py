"""eval.holdout: evaluation on a fixed draw of the training data that training never sees."""

from __future__ import annotations

from typing import Any

from rlbatch.checks.validate import check
from rlbatch.data.source import make_stream, problems_of, split_holdout
from rlbatch.data.synthetic import arithmetic_problems
from tests.unit.configs import problems, set_


def test_the_held_out_problems_are_a_fixed_draw_left_out_of_training() -> None:
    from rlbatch.config.schema import DataConfig

    every = arithmetic_problems()
    train, held = split_holdout(every, 10, seed=0)
    assert len(held) == 10 and len(train) == len(every) - 10
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(every)
    assert [p for p in every if p in set(held)] == list(held)  # the data set's order
    assert split_holdout(every, 10, seed=0) == (train, held)  # the run's seed plays no part
    assert split_holdout(every, 10, seed=1)[1] != held
    assert split_holdout(every, 0, seed=0) == (every, ())
    stream, _ = make_stream(DataConfig(), seed=3, holdout=10, holdout_seed=0)
    drawn: set[Any] = set()
    for _ in range(40):
        drawn |= set(stream.next_batch(8))
    assert drawn == set(train)  # many epochs: every training problem, no held-out one
    assert problems_of(DataConfig()) == every


def test_holdout_is_checked_before_start(cfg: dict[str, Any]) -> None:
    n = len(arithmetic_problems())
    check(set_(cfg, eval__every=5, eval__holdout=10))  # passes
    assert any(f"eval.holdout: {n} held-out problems leave none of the training data's {n} to train on" in p
               for p in problems(set_(cfg, eval__every=5, eval__holdout=n)))
    assert any("are two held-out sets" in p
               for p in problems(set_(cfg, eval__every=5, eval__holdout=10, eval__data__path="/x.jsonl")))
