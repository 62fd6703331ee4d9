"""An ``env`` role worker: a CPU process that hosts many episodes for the inference ranks.

With ``roles.env.world_size=N`` the episodes of a multi-turn rollout run here instead of on
threads of the inference rank that plays their trajectories: the process boundary then contains
what a thread cannot (an env that holds the GIL in C, blows up its memory or calls ``os._exit``
takes this worker down, and the job names it), and env CPU time is spread over nodes like the
code sandbox's. The inference rank's ``EnvClient`` (``rlbatch.envs.client``) sends each request
to the worker of its trajectory; this process answers it.

    wire (pickled, over the run's MPI communicator)
    request  tag REQUEST: (request id, op, episode id, args)   op: start | step | stop | close
    reply    tag REPLY:   (request id, Reply | RemoteError)   RemoteError: the control plane's, a
                                                               request that failed in the host itself

Each request runs on a thread of its own (a trajectory has at most one request in flight, so the
threads are bounded by the episodes hosted), inside the same guarded ``Episode`` as in-rank envs:
its limits, its timeouts and its end reasons are unchanged, and an env that raises or hangs ends
only its trajectory. An episode that ends is closed and forgotten here; its summary travels with
the reply that ended it, so no further round trip is needed.

The polling loop shares the control plane's manners (``rlbatch.runtime.control``): it never
blocks in MPI (a blocking receive spins a core), it sleeps between polls, and it runs beside the
command loop of the process, which stops it before acknowledging ``shutdown``.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlbatch.envs.episode import Episode, EpisodeSummary, Step

if TYPE_CHECKING:
    from mpi4py import MPI

    from rlbatch.config.schema import RLBatchConfig
    from rlbatch.runtime.world import World

log = logging.getLogger(__name__)

ROLE = "env"
"""The CPU role whose processes host episodes (``roles.env.world_size``)."""
REQUEST_TAG = 21
REPLY_TAG = 22
MAX_PAUSE_S = 2e-3
"""The longest sleep between polls for requests or replies: the most latency a step gains."""
HOST_THREADS = 4096
"""Requests in flight at once on one worker: one per hosted trajectory at most; a bound, not a pool
to size (threads start as requests arrive)."""
PASSED_INFO = ("detail", "tool_calls")
"""The keys of a step's ``info`` that travel back: the rollout reads none of the env's own, and an
env's info need not pickle."""


@dataclass
class Reply:
    """What a worker answers for one request: the step and, when it ended the episode, its summary."""

    step: Step
    summary: EpisodeSummary | None = None


def _wire_step(step: Step) -> Step:
    return Step(step.observation, step.reward, step.done, step.end,
                {k: step.info[k] for k in PASSED_INFO if k in step.info})


class EnvHost:
    """Episodes for the inference ranks, each keyed by (its inference rank, its episode id).

    ``comm``: an mpi4py communicator (or anything with ``improbe(source, tag)`` and ``send(obj,
    dest, tag)``); ``make_episode``: a fresh guarded episode (``EnvSetup.episode``); ``on_request``:
    called with the op before each request runs (fault injection)."""

    def __init__(self, comm: MPI.Comm, make_episode: Callable[[], Episode], name: str = ROLE,
                 on_request: Callable[[str], None] | None = None) -> None:
        self.comm, self.make_episode, self.name, self.on_request = comm, make_episode, name, on_request
        self.episodes: dict[tuple[int, int], Episode] = {}
        self.counts = {"episodes": 0, "steps": 0, "failed_requests": 0}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(HOST_THREADS, thread_name_prefix="env-host")
        self._thread = threading.Thread(target=self._serve, name="env-host", daemon=True)

    def start(self) -> EnvHost:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop polling and let requests in flight answer; log what this worker hosted."""
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)
        log.info("%s worker hosted %d episodes, %d steps (%d requests failed)", self.name,
                 self.counts["episodes"], self.counts["steps"], self.counts["failed_requests"])

    def _serve(self) -> None:
        from rlbatch.runtime.control import receive_until  # mpi4py: only where a worker serves

        try:
            receive_until(self.comm, REQUEST_TAG, self._stop.is_set,
                          lambda source, request: self._pool.submit(self._answer, source, request), MAX_PAUSE_S)
        except BaseException:
            # The clients then name this worker when their replies are overdue; the log says why.
            log.exception("%s worker stopped answering requests", self.name)
            raise

    def _answer(self, source: int, request: tuple[Any, ...]) -> None:  # as unpickled from the wire
        rid = request[0]
        try:
            reply: Reply | RemoteError = self.handle(source, *request[1:])
        except Exception:  # noqa: BLE001 (the request's failure goes back to the caller, who names this worker)
            from rlbatch.runtime.control import RemoteError

            with self._lock:
                self.counts["failed_requests"] += 1
            reply = RemoteError(traceback.format_exc())
        with self._send_lock:
            self.comm.send((rid, reply), dest=source, tag=REPLY_TAG)

    def handle(self, source: int, op: str, eid: int, args: tuple[Any, ...]) -> Reply:
        """Run one request for episode ``eid`` of inference rank ``source``."""
        if self.on_request is not None:
            self.on_request(op)
        key = (source, int(eid))
        if op == "start":
            episode = self.make_episode()
            with self._lock:
                if key in self.episodes:
                    raise ValueError(f"episode {eid} of rank {source} has already started")
                self.episodes[key] = episode
                self.counts["episodes"] += 1
            return self._reply(key, episode, episode.start(*args))
        with self._lock:
            episode = self.episodes.get(key)  # type: ignore[assignment]
        if episode is None:
            if op == "close":
                return Reply(Step(""))
            raise KeyError(f"'{op}': no episode {eid} of rank {source} on this worker (ended or never started)")
        if op == "step":
            with self._lock:
                self.counts["steps"] += 1
            return self._reply(key, episode, episode.step(*args))
        if op == "stop":
            return self._reply(key, episode, episode.stop(*args))
        if op == "close":
            self._forget(key, episode)
            return Reply(Step(""))
        raise ValueError(f"unknown env request {op!r}")

    def _reply(self, key: tuple[int, int], episode: Episode, step: Step) -> Reply:
        if not step.done:
            return Reply(_wire_step(step))
        summary = episode.summary()
        self._forget(key, episode)
        return Reply(_wire_step(step), summary)

    def _forget(self, key: tuple[int, int], episode: Episode) -> None:
        with self._lock:
            self.episodes.pop(key, None)
        episode.close()


def serve_envs(world: World, cfg: RLBatchConfig) -> EnvHost:
    """The service of an env role process (``rank_runtime.SERVICES``): episodes built from the
    run's ``env`` section, answered until the process's command loop stops it."""
    from rlbatch.envs.setup import EnvSetup
    from rlbatch.runtime.faults import maybe_fault

    setup = EnvSetup(cfg)
    rank = world.rank
    worker = dict(world.slot.roles)[ROLE]
    host = EnvHost(world.comm, setup.episode, f"{ROLE}[{worker}]",
                   on_request=lambda op: maybe_fault(f"env_{op}", rank))
    log.info("%s[%d] hosting episodes of env.name=%s", ROLE, worker, cfg.env.name)
    return host.start()
