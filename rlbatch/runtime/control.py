"""The control plane: small pickled messages over MPI, every wait bounded by a timeout.

MPI's blocking calls spin a core while they wait; on a node where ranks share cores that steals
time from the rank doing the work. Every wait here polls for at most SPIN_S, yielding the core
after each poll, then sleeps between polls; it gives up after ``timeout_s`` with an error that
names what it waited for and who did not answer.

The trade-off: a short command's reply (tens of microseconds) comes within the spin, so a round
trip costs a few MPI barriers rather than a backoff cycle; a phase of hundreds of milliseconds costs each
waiting rank SPIN_S of polling and then at most one sleep (1 ms) of extra latency. The yield
matters when ranks share cores: a spinning waiter hands its slice to the rank it waits for,
instead of holding the core until the scheduler preempts it (milliseconds).

Long waits back off further (``Patience``): a rank waiting for its next command (``serve``) and
the controller waiting for a phase's replies (``Call.wait``) sleep up to a fraction of the time
they have already waited, up to a cap, so an idle rank polls tens of times a second instead of a
thousand, and the latency this adds stays that fraction of the wait. (OpenMPI's blocking receive
and probe spin a core while they wait, which is why no wait here blocks in MPI.)
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from mpi4py import MPI

T = TypeVar("T")

Kwargs = Mapping[str, object]
"""A command's keyword arguments, as pickled to the rank that runs it."""

CMD_TAG = 11
REPLY_TAG = 12


class ControlTimeout(TimeoutError):
    """A control-plane wait expired. ``peers``: the ranks that did not answer (a command's
    ``Call.wait``), which the rank's status file records for the failure report
    (``rlbatch.runtime.postmortem``); empty for a wait on no rank in particular."""

    def __init__(self, message: str, peers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.peers = peers


NO_REPLY = "no reply from"
"""What a command's timeout says before it names the ranks that did not answer: "timed out after
{s}s waiting for {label}: no reply from {ranks}" (the failure report reads the label back)."""


SPIN_S = 1e-3
"""Poll (yielding the core between polls) this long before sleeping. It must cover a short
command's round trip even when ranks share cores: with 0.2 ms a controller and its ranks on 2
cores fell out of step and every round trip took one backoff cycle (about 4 ms)."""
MAX_PAUSE_S = 1e-3
"""The longest sleep between polls: the most a reply to a long phase waits to be noticed."""


@dataclass(frozen=True)
class Patience:
    """How a wait sleeps between polls once past its spin: from 50 us doubling to MAX_PAUSE_S, and
    beyond that up to ``fraction`` of the time waited so far, never more than ``cap_s``. A message
    is noticed at most max(MAX_PAUSE_S, min(fraction x the time waited, cap_s)) after it arrives.
    Polls of a wait of T seconds past the spin: about 1 / fraction at MAX_PAUSE_S (until the wait
    reaches MAX_PAUSE_S / fraction), ln(cap_s / MAX_PAUSE_S) / fraction while the sleep grows,
    then one per cap_s (the default, fraction 0: one per MAX_PAUSE_S throughout)."""

    fraction: float = 0.0
    cap_s: float = MAX_PAUSE_S

    def pause(self, doubling: float, waited_s: float) -> float:
        return min(max(doubling, self.fraction * waited_s), max(self.cap_s, MAX_PAUSE_S))


PROMPT = Patience()
"""At most MAX_PAUSE_S between polls, however long the wait: the default."""
IDLE = Patience(fraction=0.01, cap_s=0.02)
"""A rank waiting for its next command: a command is noticed within 1% of the rank's idle time
(1 ms in the first 0.1 s), and at most 20 ms late; an idle rank polls about 50 times a second."""
CONTROLLER = Patience(fraction=0.002, cap_s=0.005)
"""The controller waiting for a phase's replies: the last reply is noticed within 0.2% of the
phase's time (1 ms in its first half second) and at most 5 ms late, on the step's critical path."""


def wait_until(done: Callable[[], bool], timeout_s: float, what: Callable[[], str],
               patience: Patience = PROMPT) -> int:
    """Poll ``done``: spin for SPIN_S with a yield after each poll, then sleep as ``patience`` says;
    raise ControlTimeout after timeout_s. Returns the number of polls."""
    start = time.perf_counter()
    spin_until = start + SPIN_S
    polls = 0
    while True:
        polls += 1
        if done():
            return polls
        if time.perf_counter() >= spin_until:
            break
        os.sched_yield()
    deadline = start + timeout_s
    doubling = 5e-5
    while True:
        polls += 1
        if done():
            return polls
        now = time.perf_counter()
        if now > deadline:
            raise ControlTimeout(f"timed out after {timeout_s:.0f}s waiting for {what()}")
        time.sleep(min(patience.pause(doubling, now - start), deadline - now + 1e-4))  # never far past the deadline
        doubling = min(doubling * 2, MAX_PAUSE_S)


def timed_barrier(comm: MPI.Comm, timeout_s: float, what: str) -> None:
    """An MPI barrier that gives up after timeout_s, without spinning a core while it waits."""
    req = comm.Ibarrier()
    wait_until(lambda: bool(req.Test()), timeout_s, lambda: what)


def timed_bcast(comm: MPI.Comm, obj: T, root: int, timeout_s: float, what: str) -> T:
    """``comm.bcast`` that gives up after timeout_s (a timed barrier first, then the bcast). Every
    rank passes a value of the type ``root`` sends (its own is replaced by root's)."""
    timed_barrier(comm, timeout_s, f"{what}: not every rank reached the broadcast")
    out: T = comm.bcast(obj, root=root)
    return out


def recv_obj(comm: MPI.Comm, source: int, tag: int, timeout_s: float | None, what: str,
             patience: Patience = PROMPT, meanwhile: Callable[[], object] | None = None) -> Any:
    """Receive one pickled message; ``timeout_s=None`` waits for ever (still without spinning).
    The message is whatever the sender pickled, untyped as mpi4py's ``recv`` gives it: the caller
    knows what the protocol of ``tag`` sends. ``meanwhile``: called before each look for the
    message, for work the wait must not hold up."""
    status = MPI.Status()
    box: list[object] = []

    def arrived() -> bool:
        if meanwhile is not None:
            meanwhile()
        msg = comm.improbe(source=source, tag=tag, status=status)
        if msg is None:
            return False
        box.append(msg.recv())
        return True

    wait_until(arrived, float("inf") if timeout_s is None else timeout_s, lambda: what, patience)
    return box[0]


def receive_until(comm: MPI.Comm, tag: int, stop: Callable[[], bool], deliver: Callable[[int, Any], object],
                  max_pause_s: float = MAX_PAUSE_S) -> None:
    """Receive pickled messages with ``tag`` from any rank, handing each to ``deliver(source, obj)``,
    until ``stop()`` (checked before each poll). Never blocks in MPI: between polls that find nothing
    it sleeps from 50 us doubling to ``max_pause_s``, back to 50 us after a message."""
    status = MPI.Status()
    pause = 5e-5
    while not stop():
        msg = comm.improbe(source=MPI.ANY_SOURCE, tag=tag, status=status)
        if msg is None:
            time.sleep(pause)
            pause = min(pause * 2, max_pause_s)
            continue
        pause = 5e-5
        deliver(status.Get_source(), msg.recv())


def send_obj(comm: MPI.Comm, obj: object, dest: int, tag: int) -> None:
    comm.send(obj, dest=dest, tag=tag)


STATS_ENV = "RLBATCH_CONTROL_STATS"
"""A file the controller appends a snapshot to at each step's start (``StatsLog``), and counts the
bytes of its messages for; unset (the default): messages only, no file."""


@dataclass
class Traffic:
    """What went through the controller: commands sent, replies received, and (with STATS_ENV set)
    their pickled bytes. Messages are always counted (an integer add per message); bytes only where
    asked for, since counting them pickles each message a second time."""

    commands: int = 0
    command_bytes: int = 0
    replies: int = 0
    reply_bytes: int = 0
    idle_cpu_s: float = 0.0
    """With STATS_ENV set: the controller's CPU seconds spent waiting for replies that had not come
    (probes that found none, the yields and sleeps between them). How much of it there is follows
    how long the ranks work, not what the controller does: on a machine with fewer cores than ranks
    it grows with their number, on a cluster (a core for the controller) it delays nothing."""
    counting_cpu_s: float = 0.0
    """With STATS_ENV set: the CPU seconds spent pickling messages a second time to count their bytes."""


def _rss_kb() -> int:
    """This process's resident memory now (kB); 0 where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:
        return 0


class StatsLog:
    """Snapshots of the controller's process and traffic, one JSON line each, appended to the file
    STATS_ENV names (``tools/bench/scale.py`` reads them)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def from_env(cls) -> StatsLog | None:
        path = os.environ.get(STATS_ENV)
        return cls(path) if path else None

    def mark(self, traffic: Traffic, **extra: object) -> None:
        """Append a snapshot: wall (a monotonic clock and the epoch) and CPU seconds, memory (RSS
        now and at its peak, kB), ``traffic`` and ``extra`` (the data plane's counts)."""
        row = {"t": time.perf_counter(), "wall": time.time(), "cpu_s": time.process_time(), "rss_kb": _rss_kb(),
               "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, **asdict(traffic), **extra}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


class Controller:
    """The controller's end of the control plane: send a command to ranks, gather their replies.

    Every call is bounded by a timeout; a rank that does not answer in time is named (rank,
    roles, node) in the error. That bound is the watchdog for ranks that hang instead of dying.

    Replies are taken as they arrive from any rank (one probe per poll, whatever the number of
    ranks waited for), and matched to the oldest call their rank has not answered.
    """

    def __init__(self, comm: MPI.Comm, timeout_s: float, describe: Callable[[int], str] = str) -> None:
        self.comm, self.timeout_s, self.describe = comm, timeout_s, describe
        self.outstanding: dict[int, deque[Call]] = defaultdict(deque)
        """Per rank, the calls it has not answered yet, oldest first (it answers in that order)."""
        self.traffic = Traffic()
        self.count_bytes = bool(os.environ.get(STATS_ENV))
        self.probes = 0
        """Probes for a reply so far (each poll of a wait makes one, plus one per reply it takes)."""
        self.taking_cpu_s = 0.0
        """With STATS_ENV set: CPU seconds of the polls that took replies (``Traffic.idle_cpu_s``)."""

    def call(self, ranks: list[int] | tuple[int, ...], cmd: str, timeout_s: float | None = None,
             per_rank: Mapping[int, Kwargs] | None = None, label: str | None = None, **kwargs: object) -> dict[int, Any]:
        """Run ``cmd(**kwargs)`` (plus ``per_rank[r]``) on each rank; return {rank: result} (each
        handler's return value, unpickled: ``Call.wait``)."""
        return self.send(ranks, cmd, timeout_s, per_rank, label, **kwargs).wait()

    def send(self, ranks: list[int] | tuple[int, ...], cmd: str, timeout_s: float | None = None,
             per_rank: Mapping[int, Kwargs] | None = None, label: str | None = None, **kwargs: object) -> Call:
        """Send ``cmd`` and return at once; ``.wait()`` gathers the replies. Several calls may be
        in flight and be waited for in any order: a rank runs its commands and replies in the
        order they were sent, so each reply is matched to the oldest call it has not answered.
        ``label``: what the command is, for its errors (a phase's name and roles); else ``'cmd'``."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        reqs = []
        for r in ranks:
            msg = (cmd, {**kwargs, **(per_rank or {}).get(r, {})})
            reqs.append(self.comm.isend(msg, dest=r, tag=CMD_TAG))
            if self.count_bytes:
                self._count(msg, "command_bytes")
        self.traffic.commands += len(reqs)
        call = Call(self, list(ranks), cmd, timeout, reqs, label)
        for r in ranks:
            self.outstanding[r].append(call)
        return call

    def _collect(self) -> int:
        """Take every reply that has arrived, from any rank, and hand it to the call it answers
        (its rank's oldest unanswered one: a rank replies in order, and MPI keeps one sender's
        messages in order). Returns the number taken."""
        status = MPI.Status()
        start = time.process_time() if self.count_bytes else 0.0
        took = 0
        while True:
            self.probes += 1
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=REPLY_TAG)
            if msg is None:
                if took and self.count_bytes:
                    self.taking_cpu_s += time.process_time() - start
                return took
            took += 1
            value = msg.recv(status=status)
            r = status.Get_source()
            calls = self.outstanding.get(r)
            if not calls:
                raise RuntimeError(f"a reply from {self.describe(r)} that answers no command sent to it")
            calls.popleft().replies[r] = value
            if not calls:
                del self.outstanding[r]
            self.traffic.replies += 1
            if self.count_bytes:
                self._count(value, "reply_bytes")

    def _count(self, msg: object, field: str) -> None:
        """Add ``msg``'s pickled size to the traffic's ``field``: a second pickling, whose CPU time
        goes to ``Traffic.counting_cpu_s`` (the measurement's, not the controller's work)."""
        start = time.process_time()
        setattr(self.traffic, field, getattr(self.traffic, field) + len(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)))
        self.traffic.counting_cpu_s += time.process_time() - start

    def shutdown(self, ranks: list[int] | tuple[int, ...]) -> None:
        self.call(ranks, "shutdown")


class Call:
    """A command in flight."""

    def __init__(self, ctl: Controller, ranks: list[int], cmd: str, timeout_s: float, reqs: list[MPI.Request],
                 label: str | None = None) -> None:
        self.ctl, self.ranks, self.cmd, self.timeout_s, self.reqs = ctl, ranks, cmd, timeout_s, reqs
        self.label = label or f"'{cmd}'"
        self.replies: dict[int, Any] = {}
        """Each rank's reply as unpickled: its handler's return value, whose type the command
        decides (the caller of ``wait`` knows it), or a RemoteError."""

    def wait(self) -> dict[int, Any]:
        """{rank: result}; raises naming the rank when a handler failed there. The deadline is
        ``timeout_s`` from this call: a rank that has not answered by then (it hangs, or waits in a
        collective for one that does) is named, with the command's label, in a ControlTimeout
        whose ``peers`` are the ranks that did not answer."""
        def done() -> bool:
            self.ctl._collect()
            return len(self.replies) == len(self.ranks)

        def silent() -> str:
            return f"{self.label}: {NO_REPLY} " + "; ".join(self.ctl.describe(r) for r in self.ranks if r not in self.replies)

        measure = self.ctl.count_bytes
        cpu, taking = (time.process_time(), self.ctl.taking_cpu_s) if measure else (0.0, 0.0)
        try:
            wait_until(done, self.timeout_s, silent, CONTROLLER)
        except ControlTimeout as e:
            raise ControlTimeout(str(e), tuple(r for r in self.ranks if r not in self.replies)) from None
        if measure:  # the wait's CPU but for the polls that took replies: waiting for ranks still at work
            self.ctl.traffic.idle_cpu_s += time.process_time() - cpu - (self.ctl.taking_cpu_s - taking)
        replies = self.replies
        for req in self.reqs:
            req.wait()
        failed = {r: v for r, v in replies.items() if isinstance(v, RemoteError)}
        if failed:
            r, err = next(iter(sorted(failed.items())))
            raise RuntimeError(f"{self.label} failed on {self.ctl.describe(r)}:\n{err.traceback}")
        return replies


class RemoteError:
    """A worker's exception, sent back to the controller as its reply."""

    def __init__(self, traceback: str) -> None:
        self.traceback = traceback


def serve(comm: MPI.Comm, controller_rank: int, handlers: Mapping[str, Callable[..., object]]) -> None:
    """A worker's loop: run each command from the controller until 'shutdown' (the handler of that
    name, if any, runs before it is acknowledged: the rank's own teardown, such as stopping what it
    serves to other ranks).

    An exception in a handler goes back to the controller as the reply (so the controller names
    the rank and stops the run) and is then re-raised here.
    """
    import traceback

    while True:
        cmd, kwargs = recv_obj(comm, controller_rank, CMD_TAG, None, "the next command", IDLE)
        if cmd == "shutdown":
            if "shutdown" in handlers:
                handlers["shutdown"]()
            send_obj(comm, None, controller_rank, REPLY_TAG)
            return
        try:
            if cmd not in handlers:
                raise KeyError(f"unknown command {cmd!r}; this rank handles {sorted(handlers)}")
            result = handlers[cmd](**kwargs)
        except BaseException as exc:  # a library's BaseException (DCP's CheckpointException) is a failure too
            if not isinstance(exc, (SystemExit, KeyboardInterrupt)):
                send_obj(comm, RemoteError(traceback.format_exc()), controller_rank, REPLY_TAG)
            raise
        send_obj(comm, result, controller_rank, REPLY_TAG)
