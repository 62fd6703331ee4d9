"""Multi-turn rollouts on an inference worker of several ranks (tensor-parallel vLLM, ``vllm:dXtY``).

The ranks of such a worker run one engine together (vLLM's ``external_launcher``): every rank must
add the same requests and take the same engine steps, in the same order, or their collectives
mismatch. One rank plays the trajectories, the worker's first (the leader): its envs, its
``Rollout``; its ``Turns`` are a ``Lockstep`` that sends each call to the other ranks (the
followers) before making it, and the followers make the same calls on their engines (``follow``)
until the leader says the rollout is over. Then the leader sends them the trajectories, so every
rank of the worker holds the samples, as after a single-turn generation.

    leader:    turns = Lockstep(turns_of(engine), comm, followers);  done = rollout(turns, ...)
               turns.finish(done)
    follower:  done = follow(turns_of(engine), comm, leader)

A poll is sent step by step (``poll(block=False)`` advances the engine once), so a follower's engine
takes exactly the leader's steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbatch.engines.base import Generation, SamplingParams, TurnRequest, Turns
from rlbatch.runtime.control import recv_obj, send_obj

if TYPE_CHECKING:
    from mpi4py import MPI

    from rlbatch.envs.rollout import Trajectory

TAG = 23
"""MPI tag of the leader's calls (the control plane uses 11-12, the env role 21-22)."""


class Lockstep:
    """The leader's ``Turns``: ``inner``'s, each call sent to ``followers`` (world ranks) first."""

    def __init__(self, inner: Turns, comm: MPI.Comm, followers: list[int]) -> None:
        self.inner, self.comm, self.followers = inner, comm, list(followers)

    def _send(self, message: tuple[object, ...]) -> None:
        for rank in self.followers:
            send_obj(self.comm, message, rank, TAG)

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        self._send(("submit", requests, params))
        self.inner.submit(requests, params)

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        while True:
            self._send(("step",))
            out = self.inner.poll(block=False)
            if out or not block or not self.inner.in_flight():
                return out

    def in_flight(self) -> int:
        return self.inner.in_flight()

    def finish(self, result: list[Trajectory]) -> None:
        """The rollout is over: the followers stop following and get ``result`` (its trajectories)."""
        self._send(("done", result))


def follow(inner: Turns, comm: MPI.Comm, leader: int) -> list[Trajectory]:
    """Make the leader's calls on this rank's engine until it finishes; returns what it sent then
    (the trajectories)."""
    while True:
        message = recv_obj(comm, leader, TAG, None, f"the rollout's next call from rank {leader}")
        if message[0] == "submit":
            inner.submit(message[1], message[2])
        elif message[0] == "step":
            inner.poll(block=False)
        elif message[0] == "done":
            return message[1]
        else:
            raise ValueError(f"unknown lockstep call {message[0]!r} from rank {leader}")
