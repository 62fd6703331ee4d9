"""The planner with an environment (``env.name``): the trainer reads whole trajectories, generation
runs turn by turn over the growing context, and env steps lie on each trajectory's critical path."""

from __future__ import annotations

import pytest
from conftest import make_config, make_layout, workload_of

from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import ModelShape
from rlbatch.models.spec import spec_from_config
from rlbatch.plan.predict import predict

ALGO = {"max_new_tokens": 4, "prompts_per_step": 8, "samples_per_prompt": 8}


def _plan(env: dict, **episodes: float):  # type: ignore[no-untyped-def]
    cfg = make_config(env=env, algo=ALGO, data={"name": "none"} if env else {})
    w = workload_of(cfg, response_mean=2.0, **episodes)
    return w, predict(make_layout(cfg), ModelShape.of(spec_from_config(cfg["model"])), w, load_hardware("cpu"))


def test_a_trajectory_is_its_turns_and_observations() -> None:
    w, _ = _plan({"name": "running_sum", "max_turns": 3}, observation_len=3.0)
    assert (w.turns, w.turn_response_mean, w.observation_len) == (3.0, 2.0, 3.0)
    assert w.response_mean == 3 * 2.0 + 2 * 3.0 and w.response_max == 3 * 4 + 2 * 3  # what the trainer reads
    assert w.prompt_len == 1 + 3.0  # data.name=none: a BOS, then the first observation
    assert w.generated_tokens == w.sequences * 3 * 2.0  # observations are not generated
    turns = w.turn_workloads()
    assert [round(t.prompt_len) for t, _ in turns] == [4, 9, 14] and all(t.response_max == 4 for t, _ in turns)
    w2, _ = _plan({"name": "running_sum", "max_turns": 3}, turns=2.5, observation_len=3.0)
    assert [weight for _, weight in w2.turn_workloads()] == [1.0, 1.0, 0.5]


def test_turns_and_env_steps_lengthen_the_step() -> None:
    _, one = _plan({})
    _, three = _plan({"name": "running_sum", "max_turns": 3}, observation_len=3.0)
    gen1, gen3 = one.phase("generate"), three.phase("generate")
    assert gen1 is not None and gen3 is not None and gen3.seconds > 2 * gen1.seconds
    t1, t3 = one.phase("train"), three.phase("train")
    assert t1 is not None and t3 is not None and t3.seconds > t1.seconds  # longer sequences to train on
    _, slow = _plan({"name": "running_sum", "max_turns": 3}, observation_len=3.0, env_step_s=2.0)
    gen = slow.phase("generate")
    assert gen is not None and gen.seconds >= 3 * 2.0  # each trajectory waits for its env three times
    assert gen.seconds == pytest.approx(gen3.seconds + gen.features["env"], rel=1e-6)
    assert any("multi-turn rollout: 3 turns" in n for n in slow.notes)


def test_env_workers_add_their_round_trips_to_the_generate_phase() -> None:
    """With the env role, each trajectory's start and steps are round trips to a worker, sent and
    received on its inference rank: the busiest rank's count, at the prior's seconds each."""
    from rlbatch.plan.coefficients import PRIORS

    env = {"name": "running_sum", "max_turns": 3}
    _, local = _plan(env, observation_len=3.0)
    cfg = make_config(env=env, algo=ALGO, data={"name": "none"}, roles={"env": {"world_size": 2}})
    w = workload_of(cfg, response_mean=2.0, observation_len=3.0)
    remote = predict(make_layout(cfg), ModelShape.of(spec_from_config(cfg["model"])), w, load_hardware("cpu"))
    assert w.env_workers == 2 and local.phase("generate").features.get("env_calls") is None  # type: ignore[union-attr]
    gen = remote.phase("generate")
    assert gen is not None
    replicas = make_layout(cfg).roles["actor_infer"].backend.d  # type: ignore[union-attr]
    assert gen.features["env_calls"] == -(-8 * 8 // replicas) * (3 + 1)
    assert gen.seconds == pytest.approx(local.phase("generate").seconds  # type: ignore[union-attr]
                                        + gen.features["env_calls"] * PRIORS["env_calls"], rel=1e-6)
