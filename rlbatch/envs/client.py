"""The inference rank's end of the ``env`` role: episodes that live on env workers.

    client = EnvClient(comm, env_ranks, timeout_s=step_timeout_s + REPLY_MARGIN_S)
    episode = client.episode(worker=sample_id % client.size)   # as an Episode, to the Rollout
    first = episode.start(task, seed)                          # one round trip to that worker

A ``RemoteEpisode`` has the methods of ``Episode`` that ``Rollout`` calls (start, step, stop,
summary, close), so the rollout loop is the same whether envs run on its threads or on workers.
Trajectories are spread over the workers by their sample id (``worker_of``): every inference rank
spreads its share the same way, so the workers get even shares of the step's trajectories.

Failures: an env that raises, hangs or returns garbage ends its trajectory on the worker, as in the
rank (the worker's ``Episode`` guards it). What fails here is the worker itself: a request its host
could not run comes back as an error, and a worker silent for longer than a step may take
(``timeout_s``) is named; either raises ``EnvWorkerError`` and ends the job. A worker killed
outright ends the job through the launcher (mpiexec, srun), which names its rank and role.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from rlbatch.envs.base import Task
from rlbatch.envs.episode import EpisodeSummary, Step
from rlbatch.envs.host import MAX_PAUSE_S, REPLY_TAG, REQUEST_TAG, ROLE, Reply

if TYPE_CHECKING:
    from mpi4py import MPI

    from rlbatch.config.schema import RLBatchConfig
    from rlbatch.runtime.control import RemoteError
    from rlbatch.runtime.world import World

REPLY_MARGIN_S = 60.0
"""How much longer than ``env.step_timeout_s`` a worker may take to answer before it is declared
unresponsive: the worker's own timeout answers a hung env within the step timeout; what is left
covers a loaded node (thread start, the pickled round trip)."""


class EnvWorkerError(RuntimeError):
    """An env worker failed or stopped answering; the message names the role, worker and rank."""


def worker_of(sample_id: int, workers: int) -> int:
    """The env worker that hosts a trajectory: by its sample id, the same on every inference rank."""
    return int(sample_id) % workers


class EnvClient:
    """Sends episode requests to the env role's processes (``ranks``, in worker order) and matches
    their replies. Thread-safe: the rollout's threads call it at once; one receiver thread, alive
    while requests are in flight, takes every reply and hands it to its caller."""

    def __init__(self, comm: MPI.Comm, ranks: Sequence[int], timeout_s: float, role: str = ROLE) -> None:
        if not ranks:
            raise ValueError(f"{role} role: no worker ranks")
        self.comm, self.ranks, self.timeout_s, self.role = comm, list(ranks), float(timeout_s), role
        self._ids = itertools.count()
        self._episode_ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[Reply | RemoteError]] = {}
        self._receiver: threading.Thread | None = None
        self.requests = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    def describe(self, worker: int) -> str:
        return f"{self.role}[{worker}] (rank {self.ranks[worker]})"

    def episode(self, worker: int) -> RemoteEpisode:
        return RemoteEpisode(self, worker, next(self._episode_ids))

    def call(self, worker: int, op: str, eid: int, *args: object) -> Reply:
        """One request to ``worker``; its reply, or EnvWorkerError naming the worker."""
        rid = next(self._ids)
        fut: Future[Reply | RemoteError] = Future()
        with self._lock:
            self._pending[rid] = fut
            self.requests += 1
            if self._receiver is None:
                self._receiver = threading.Thread(target=self._receive, name="env-client", daemon=True)
                self._receiver.start()
        self.comm.send((rid, op, eid, args), dest=self.ranks[worker], tag=REQUEST_TAG)
        try:
            reply = fut.result(self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(rid, None)
            raise EnvWorkerError(f"{self.describe(worker)} did not answer '{op}' within {self.timeout_s:.0f}s "
                                 f"(env.step_timeout_s plus {REPLY_MARGIN_S:.0f}s): the worker is stuck") from None
        if not isinstance(reply, Reply):  # the control plane's RemoteError: the host itself failed
            raise EnvWorkerError(f"{self.describe(worker)} failed on '{op}':\n{reply.traceback}")
        return reply

    def _receive(self) -> None:
        from rlbatch.runtime.control import receive_until  # mpi4py: only once a worker is called

        receive_until(self.comm, REPLY_TAG, self._idle, self._deliver, MAX_PAUSE_S)

    def _idle(self) -> bool:
        """No request in flight: the receiver thread ends (the next request starts another)."""
        with self._lock:
            if self._pending:
                return False
            self._receiver = None
            return True

    def _deliver(self, source: int, message: tuple[int, Reply | RemoteError]) -> None:
        rid, reply = message
        with self._lock:
            fut = self._pending.pop(rid, None)
        if fut is not None:  # None: its caller gave up (and raised)
            fut.set_result(reply)


class RemoteEpisode:
    """An episode hosted by one env worker, driven like ``Episode`` (one caller at a time)."""

    def __init__(self, client: EnvClient, worker: int, eid: int) -> None:
        self.client, self.worker, self.eid = client, worker, eid
        self.ended: EpisodeSummary | None = None
        """The episode's summary, from the reply that ended it (the worker has forgotten it)."""
        self.started = False

    def _call(self, op: str, *args: object) -> Step:
        reply = self.client.call(self.worker, op, self.eid, *args)
        if reply.summary is not None:
            self.ended = {**reply.summary, "worker": self.worker}
        return reply.step

    def start(self, task: Task, seed: int) -> Step:
        self.started = True
        return self._call("start", dict(task), int(seed))

    def step(self, action: str) -> Step:
        return self._call("step", action)

    def stop(self, reason: str, detail: str = "") -> Step:
        if self.ended is not None:
            return Step("", 0.0, True, self.ended.get("end"), {})
        return self._call("stop", reason, detail)

    def summary(self) -> EpisodeSummary:
        if self.ended is None:
            raise RuntimeError(f"episode {self.eid} on {self.client.describe(self.worker)} has not ended")
        return self.ended.copy()

    def close(self) -> None:
        """Nothing to do for an ended episode (its worker closed it); else the worker closes it."""
        if self.started and self.ended is None:
            self.ended = {}
            self.client.call(self.worker, "close", self.eid)


def env_client(world: World, cfg: RLBatchConfig) -> EnvClient | None:
    """The client of the run's env role, when the placement has one (else None: envs run on the
    inference rank's threads)."""
    role = world.placement.roles.get(ROLE)
    if role is None:
        return None
    ranks = [w[0] for w in role.workers]
    return EnvClient(world.comm, ranks, float(cfg.env.step_timeout_s) + REPLY_MARGIN_S)
