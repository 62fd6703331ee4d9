"""Multi-turn rollouts on a worker of several ranks (rlbatch.envs.lockstep): the leader plays the
trajectories and its engine calls reach the follower first, so the follower's engine makes exactly
the same calls, step by step, and gets the trajectories at the end. Over the in-process stand-in
for the MPI communicator (tests/unit/test_env_role.py); tests/dist/test_learning.py runs it with
vLLM at t=2."""

from __future__ import annotations

import threading
from typing import Any

from rlbatch.engines.base import Generation, SamplingParams, TurnRequest
from rlbatch.envs.chat import PlainText
from rlbatch.envs.lockstep import Lockstep, follow
from rlbatch.envs.rollout import Rollout
from tests.unit.test_env_role import Net
from tests.unit.test_envs_rollout import ScriptedTurns, decode, encode, starts


class Logged(ScriptedTurns):
    """ScriptedTurns that logs every call it gets: ('submit', requests) and each engine step
    ('step', requests in flight)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.log: list[tuple[str, Any]] = []

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        self.log.append(("submit", [(r.key, tuple(r.tokens), r.seed) for r in requests]))
        super().submit(requests, params)

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        out: list[tuple[int, Generation]] = []
        while self.running:  # as vLLM's: an engine step at a time, until one finishes when blocking
            self.log.append(("step", self.in_flight()))
            out = super().poll(block=False)
            if out or not block:
                break
        return out


def test_the_follower_makes_the_leaders_calls_and_gets_its_trajectories() -> None:
    net = Net()
    leader_comm, follower_comm = net.comm(0), net.comm(1)
    leader, follower = Logged(extra={1: 3, 4: 5}), Logged(extra={1: 3, 4: 5})
    got: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: got.setdefault("done", follow(follower, follower_comm, 0)))
    thread.start()
    turns = Lockstep(leader, leader_comm, [1])
    # some envs slow: turns are submitted while others are generating, the engine steps in between
    done = Rollout(turns, PlainText(encode), decode, SamplingParams(4)).run(starts(6, delays={2: 0.05, 5: 0.1}))
    turns.finish(done)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert follower.log == leader.log and any(kind == "submit" for kind, _ in leader.log)
    assert sum(kind == "step" for kind, _ in leader.log) > len(done) * 3  # step by step, not a poll each
    assert [(t.key, t.prompt, t.response, t.loss_mask) for t in got["done"]] == \
        [(t.key, t.prompt, t.response, t.loss_mask) for t in done]
    assert all(t.end == "done" for t in done)
