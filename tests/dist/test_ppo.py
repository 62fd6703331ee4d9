"""PPO with a critic learns the default task: the critic colocated with the actor (fsdp, the
``algo=ppo`` preset as it is), and on a GPU rank of its own with the deepspeed engine while the
actor trains and generates on two others (the first 30 steps). Runs are deterministic with the seed
(not flaky)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch
from tests.dist.test_learning import best_mean

pytestmark = pytest.mark.dist

PLACEMENTS = {
    # placement -> (overrides, steps). Colocated: about 1.5x the step by which the 3-step mean reward
    # first reached 0.8 (41; docs/algorithms.md). The critic on its own rank: the same run's first 30
    # steps (seeded: the 3-step mean is 0.59 by then and reaches 0.8 at step 48).
    "colocated": ([], 60),
    "critic-own-rank": (["roles=disaggregated", "roles.critic.device_mapping=[2]", "roles.critic.backend=deepspeed:d1"], 30),
}


def test_ppo_trains_the_actor_and_its_critic(run_root: Path) -> None:
    """The fast tier's: three steps of the ``algo=ppo`` preset (the critic colocated with the actor):
    the critic's values and GAE's advantages every step, the critic regressed on the returns while
    the actor trains."""
    # the format reward (a digit, then EOS) is earned at once: returns that vary from the first step
    out = launch(["algo=ppo", "steps=3", "data.reward_fn=rlbatch.rewards.rules:format_reward",
                  f"run_dir={run_root / 'run'}"], run_root)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["critic/warmup"] == 0.0 and row["train/critic/value_loss"] > 0, row
        assert -10.0 < row["critic/explained_variance"] <= 1.0 and row["train/pg_loss"] == row["train/pg_loss"], row
    assert len({row["train/critic/value_loss"] for row in rows}) == 3  # the critic trains


@pytest.mark.full
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_ppo_with_a_critic_learns_the_default_task(run_root: Path, placement: str) -> None:
    overrides, steps = PLACEMENTS[placement]
    out = launch(["algo=ppo", f"steps={steps}", *overrides, f"run_dir={run_root / 'run'}"], run_root, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_root / "run" / "metrics.jsonl").read_text().splitlines()]
    r = [row["reward_mean"] for row in rows]
    assert all(row["critic/warmup"] == 0.0 for row in rows)
    ev = [row["critic/explained_variance"] for row in rows]
    if steps < 60:  # rising, with a critic whose values already explain part of the returns (0.48)
        assert r[0] <= 0.05 and best_mean(r) >= 0.4 and sum(ev[-10:]) / 10 > 0.3, (r, ev)
        return
    assert r[0] <= 0.2 and best_mean(r) >= 0.8, r
    # The critic learns too: its loss falls from its peak (rewards appear) to well below it, and its
    # values explain a good part of the returns' variance by the end. Once nearly every answer is right
    # the returns barely vary and a step's explained variance swings (-0.2 to 0.8 from one step to the
    # next), so it is averaged over the last 20 steps: 0.46-0.71 in 7 colocated runs (seeds 1-4, and
    # seeds 2-4 of an earlier random initialisation; over the last 10 steps 0.37-0.71).
    loss = [row["train/critic/value_loss"] for row in rows]
    window = [sum(loss[k : k + 10]) / 10 for k in range(len(loss) - 9)]
    assert window[-1] < 0.5 * max(window), window
    assert sum(ev[-20:]) / 20 > 0.4, ev
