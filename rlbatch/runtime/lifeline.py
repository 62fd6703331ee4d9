"""Lifelines: one Unix socket from each rank of a local run to its launcher, open for the rank's life.

When a rank dies, mpiexec (Hydra) sees its PMI socket close and kills every other rank within
milliseconds; afterwards they all look alike. The kernel closes a dying process's sockets
together, the PMI socket and the lifeline in one pass, so the launcher reads the dying rank's
lifeline end before Hydra can even send its kills: the order in which lifelines end is the order
of cause and consequence. (A process's own exit, as a pidfd reports it, comes later: only once
every one of its threads is gone, and on a loaded machine the ranks Hydra killed may be gone
first.)

    launcher:  lines = Lifelines();  env[ENV] = lines.address;  ... lines.register(selector) ...
    rank:      hold(rank)     # as soon as it knows its rank; does nothing outside a local run

The lifeline is held above every descriptor the rank inherited (the kernel closes the highest
first), is not inherited by programs the rank starts, and is closed in children it forks (a child
holding it would make a dead rank look alive).
"""

from __future__ import annotations

import fcntl
import os
import selectors
import socket
import struct
import time

from rlbatch.runtime.env import VARS, read_env

ENV = VARS["lifeline"][0]
"""The launcher's abstract socket name, in every rank's environment."""
LOW_FD = 100
"""The lifeline's lowest descriptor: above Hydra's PMI_FD and the descriptors a rank inherits."""

_held: socket.socket | None = None


def hold(rank: int) -> None:
    """Connect this rank's lifeline and keep it until the process ends (no-op without ``ENV``, or
    when the launcher is gone: its report then falls back to the ranks' status files)."""
    global _held
    env = read_env()
    address = env.lifeline
    if not address or _held is not None:
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + address)
        s.sendall(f"{rank}\n".encode())
        high = fcntl.fcntl(s.fileno(), fcntl.F_DUPFD_CLOEXEC, max(LOW_FD, (env.pmi_fd or 0) + 1))
    except OSError:
        return
    finally:
        s.close()
    _held = socket.socket(fileno=high)
    os.register_at_fork(after_in_child=_drop)


def _same_user(conn: socket.socket) -> bool:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid == os.getuid()


def _drop() -> None:
    global _held
    if _held is not None:
        _held.close()
        _held = None


class Lifelines:
    """The launcher's end: a listening socket, the ranks' connections, the order they ended in.

    ``register`` puts the listener on a selector; ``handle(key)`` takes every event whose
    ``key.data`` is this object's (new connections, rank numbers, ends) and says whether it was
    one. ``first(window_s)``: the ranks whose lifelines ended within ``window_s`` of the first,
    in the order they ended; none when a rank ended before all ``world_size`` had connected (the
    one that died may be a rank that never did)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.address = f"rlbatch-{os.getpid()}-{time.time_ns()}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.address)
        self.listener.listen(1024)
        self.listener.setblocking(False)
        self.ended: list[tuple[float, int]] = []
        self.all_held_at_first_end: bool | None = None
        self._conns: dict[int, tuple[socket.socket, bytearray]] = {}
        self._sel: selectors.BaseSelector | None = None

    def register(self, sel: selectors.BaseSelector) -> None:
        self._sel = sel
        sel.register(self.listener, selectors.EVENT_READ, self)

    def handle(self, key: selectors.SelectorKey) -> bool:
        if key.data is not self:
            return False
        assert self._sel is not None
        if key.fileobj is self.listener:
            self._accept()
            return True
        conn, said = self._conns[key.fd]
        try:
            chunk = conn.recv(64)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            chunk = b""
        if chunk:
            said += chunk
            return True
        if self.all_held_at_first_end is None:
            self._accept()  # connections the selector has not reported yet
            self.all_held_at_first_end = len(self._conns) >= self.world_size
        self._sel.unregister(conn)
        del self._conns[key.fd]
        conn.close()
        rank = said.split(b"\n", 1)[0]
        if rank.isdigit():
            self.ended.append((time.monotonic(), int(rank)))
        return True

    def _accept(self) -> None:
        assert self._sel is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            if not _same_user(conn):  # the name is visible to every user of the machine
                conn.close()
                continue
            conn.setblocking(False)
            self._conns[conn.fileno()] = (conn, bytearray())
            self._sel.register(conn, selectors.EVENT_READ, self)

    def drain(self, sel: selectors.BaseSelector, quiet_s: float = 0.2) -> None:
        """Take the events still pending (mpiexec's output can end before the last lifelines'
        ends are read), until none comes for ``quiet_s``."""
        while events := sel.select(timeout=quiet_s):
            for key, _ in events:
                self.handle(key)

    def first(self, window_s: float) -> list[int]:
        if not self.ended or not self.all_held_at_first_end:
            return []
        t0 = self.ended[0][0]
        return [rank for at, rank in self.ended if at <= t0 + window_s]

    def close(self) -> None:
        for conn, _ in self._conns.values():
            conn.close()
        self._conns.clear()
        self.listener.close()

    def __enter__(self) -> Lifelines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
