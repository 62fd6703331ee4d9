"""Which containment this node allows, the command line that applies it, and whose uid an execution runs as.

Namespaces come from util-linux ``unshare`` (present on every Linux node; no daemon, no setuid
helper): ``--user --map-root-user`` works for an unprivileged user where the kernel allows
unprivileged user namespaces, and for root. The probe runs once per process.

Users: a root worker runs each execution as a uid of its own, from ``UID_BASE`` (``lease``): no
account's, held by that execution alone while it runs (a lock file per uid, so workers in separate
processes on one node cannot collide). RLIMIT_NPROC counts per uid, so ``limits.processes`` is then
the execution's own budget whatever else runs on the node. A worker that is not root can only run
executions as its own user: the kernel then counts that user's processes on the whole node (per user
namespace under ``namespaces``, on Linux >= 5.14), and ``nproc_limit`` adds those already running to
each execution's limit.
"""

from __future__ import annotations

import fcntl
import functools
import grp
import logging
import os
import pwd
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from rlbatch.sandbox.harness import DENIED_SYSCALLS, OWN_DIRS, READ_ONLY_DIRS, landlock_abi

log = logging.getLogger(__name__)

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
INTERPRETERS = (os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "/usr/bin/python3")
"""Candidates for the executions' interpreter, in order: this one's base (the harness needs the
standard library only, ``-I -S``), else the system's (as another user than root, an interpreter
under root's home cannot be run)."""
NOBODY = 65534
UID_BASE = 2_080_000_000
UID_COUNT = 65536
"""The executions' uids (and gids) under a root worker: ``UID_BASE`` .. ``UID_BASE + UID_COUNT - 1``,
above the ranges that accounts and their delegated ids take by default (useradd's subordinate ids
end at 600100000, systemd's container range at 1879048191, sssd's id mapping at 2000200000) and
below both 2^31 (tools that read a uid as a signed int) and systemd's foreign range (2147352576).
A uid or gid of the range that names an account or group on this node is skipped."""
LOCK_DIRS = ("/run/rlbatch-uids", "")
"""Where a root worker keeps one lock file per uid in use (node-local, root's alone); ``""`` stands
for ``<tempdir>/rlbatch-uids``, used where ``/run`` is not writable."""
NAMESPACE_FLAGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
                   "--mount-proc", "--ipc", "--uts")
HARNESS_TASKS = {"process": 1, "namespaces": 2}
"""Tasks of an execution's uid that are not its code's: the judge and, under namespaces, ``unshare``
(it enters the execution's user namespace before it forks the judge)."""


def _maps(path: str, first: int, count: int) -> bool:
    """Whether this process's user namespace maps ids ``first`` .. ``first + count - 1`` (a uid_map
    or gid_map: ``inside outside count`` per line)."""
    try:
        with open(path) as f:
            ranges = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except (OSError, ValueError):
        return False
    return any(inside <= first and first + count <= inside + n for inside, _, n in ranges)


@functools.lru_cache(maxsize=1)
def users() -> str:
    """Whose uid the executions run as: ``own`` (a root worker: each its own uid from ``UID_BASE``),
    ``nobody`` (root in a user namespace that does not map that range but maps ``nobody``: every
    execution as ``nobody``) or ``worker`` (the worker's own user)."""
    if os.geteuid() != 0:
        return "worker"
    for who, first, count in (("own", UID_BASE, UID_COUNT), ("nobody", NOBODY, 1)):
        if _maps("/proc/self/uid_map", first, count) and _maps("/proc/self/gid_map", first, count):
            return who
    return "worker"


def runs_as_other_user() -> bool:
    """Whether the executions run as a user other than the worker's (then they cannot reach its
    files and processes by their permissions)."""
    return users() != "worker"


def counts_per_user_namespace() -> bool:
    """Whether the kernel counts RLIMIT_NPROC per user namespace (Linux >= 5.14): under
    ``namespaces`` an execution then counts only its own processes, whatever its uid."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


def shares_process_budget(mode: str) -> bool:
    """Whether the processes of other executions (and of the worker's user) count against an
    execution's RLIMIT_NPROC under ``mode``."""
    return users() != "own" and (mode == "process" or not counts_per_user_namespace())


def tasks_of(uid: int) -> int:
    """Tasks (processes and threads, zombies included) whose real uid is ``uid``, as far as this pid
    namespace shows them: what the kernel counts against RLIMIT_NPROC for that uid."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
            uid_line = status.split(b"\nUid:", 1)[1]
            if int(uid_line.split(None, 1)[0]) == uid:
                count += int(status.split(b"\nThreads:", 1)[1].split(None, 1)[0])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return count


_LOCK = threading.Lock()
_ACCOUNTS: dict[int, bool] = {}
"""uid -> whether a user or group of this node has it (looked up once per worker)."""
_SETTLING: list[tuple[int, str, int, float]] = []
"""Uids whose execution ended while processes of it were still there (killed, not yet reaped):
(lock descriptor, lock path, process group, since); given back once the group is gone."""


@functools.lru_cache(maxsize=1)
def _lock_dir() -> str:
    tried = []
    for path in LOCK_DIRS:
        path = path or os.path.join(tempfile.gettempdir(), "rlbatch-uids")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            tried.append(f"{path}: {exc.strerror}")
            continue
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            return path
        tried.append(f"{path}: not a directory of root's alone")
    raise RuntimeError(f"sandbox: no directory for the executions' uid locks ({'; '.join(tried)})")


def _unused(uid: int) -> bool:
    if uid not in _ACCOUNTS:
        used = []
        for kind, lookup in (("user", pwd.getpwuid), ("group", grp.getgrgid)):
            try:
                lookup(uid)
                used.append(kind)
            except KeyError:
                pass
        if used:
            log.warning("sandbox: uid %d of the executions' range is a %s on this node: skipped", uid,
                        " and a ".join(used))
        _ACCOUNTS[uid] = bool(used)
    return not _ACCOUNTS[uid]


def _settle() -> None:
    """Give back the settling uids whose processes are all gone."""
    with _LOCK:
        for entry in list(_SETTLING):
            fd, path, group, since = entry
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                _SETTLING.remove(entry)
                _unlock(fd, path)
                continue
            except PermissionError:
                pass
            if since and time.monotonic() - since > 60:
                log.warning("sandbox: uid %s still has processes 60 s after its execution ended (not reaped "
                            "by the node's init?): kept out of use until they are gone", os.path.basename(path))
                _SETTLING[_SETTLING.index(entry)] = (fd, path, group, 0.0)


def _unlock(fd: int, path: str) -> None:
    # Removed while still locked: a worker that opened it meanwhile sees, once it gets the lock,
    # that the path names another file (or none) and tries again.
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


@dataclass
class Lease:
    """The user one execution runs as, from ``lease()`` until ``release()``."""

    uid: int | None
    """Its uid; None: the worker's own."""
    shared: bool
    """Whether other processes (other executions, the worker's) have that uid too."""
    fd: int = -1
    path: str = ""

    def popen_kwargs(self) -> dict[str, Any]:
        """``subprocess.Popen`` arguments that start the execution as this user, no other groups."""
        return {} if self.uid is None else {"user": self.uid, "group": self.uid, "extra_groups": []}

    def counted_uid(self) -> int:
        return os.getuid() if self.uid is None else self.uid

    def release(self, group: int | None = None) -> None:
        """Give the uid back; while process group ``group`` (the execution's, already killed) still
        has processes, only once they are gone."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        if group is not None:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                group = None
            except PermissionError:
                pass
        if group is None:
            _unlock(fd, self.path)
        else:
            with _LOCK:
                _SETTLING.append((fd, self.path, group, time.monotonic()))

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lease() -> Lease:
    """The user for one execution: as root, a uid of ``UID_BASE``'s range that no other execution on
    this node holds (race-free across threads and processes: an exclusive ``flock`` on the uid's
    lock file, which the kernel releases if the worker dies); else the shared one (``users()``)."""
    who = users()
    if who != "own":
        return Lease(NOBODY if who == "nobody" else None, shared=True)
    _settle()
    directory = _lock_dir()
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):
        if not _unused(uid):
            continue
        path = os.path.join(directory, str(uid))
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:  # the directory was removed (a clean-up of /run or /tmp)
                _lock_dir.cache_clear()
                path = os.path.join(_lock_dir(), str(uid))
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                break  # another execution's
            try:
                named = os.stat(path)
            except FileNotFoundError:
                named = None
            held = os.fstat(fd)
            if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                return Lease(uid, shared=False, fd=fd, path=path)
            os.close(fd)  # its holder gave it back between our open and our lock: again
    raise RuntimeError(f"sandbox: all {UID_COUNT} execution uids from {UID_BASE} are in use on this node")


def nproc_limit(mode: str, processes: int, user: Lease) -> int:
    """RLIMIT_NPROC for an execution whose code may have ``processes`` processes and threads of its
    own (itself included): the kernel counts every task of the uid (in the user namespace, under
    ``namespaces`` on Linux >= 5.14), so add the harness's and, where the uid is shared, those it has
    now (the worker's, other executions'): the later ones of those draw from the same budget. At
    most the worker's own hard limit (the execution inherits it and cannot raise it)."""
    base = HARNESS_TASKS[mode]
    if shares_process_budget(mode):
        base += tasks_of(user.counted_uid())
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    return base + processes if hard == resource.RLIM_INFINITY else min(base + processes, hard)


def _runs(cmd: list[str], **popen: Any) -> str:
    """'' when ``cmd`` exits 0, else why not."""
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, **popen)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return "" if proc.returncode == 0 else proc.stderr.decode(errors="replace").strip()[:200] or f"exit {proc.returncode}"


@functools.lru_cache(maxsize=2)
def interpreter(mode: str) -> str:
    """The first interpreter an execution under ``mode``, as its user, can start."""
    prefix = [shutil.which("unshare") or "unshare", *NAMESPACE_FLAGS] if mode == "namespaces" else []
    why = {}
    with lease() as user:
        for python in INTERPRETERS:
            if os.path.exists(python):
                why[python] = _runs([*prefix, python, "-I", "-S", "-c", "pass"], **user.popen_kwargs())
                if not why[python]:
                    return python
    raise RuntimeError(f"sandbox ({mode}): no interpreter starts: {why}")


@functools.lru_cache(maxsize=1)
def namespaces_available() -> tuple[bool, str]:
    """Whether ``unshare`` can give an execution its own namespaces here, and why not."""
    if shutil.which("unshare") is None:
        return False, "util-linux unshare not found"
    try:
        interpreter("namespaces")
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


def resolve(isolation: str) -> str:
    """``auto`` -> ``namespaces`` or ``process``; ``namespaces`` where unavailable is an error. The
    ``process`` mode says in the log what it leaves open."""
    if isolation not in ("auto", "namespaces", "process"):
        raise ValueError(f"sandbox.isolation must be auto, namespaces or process, got {isolation!r}")
    machine = os.uname().machine
    if machine not in DENIED_SYSCALLS:
        raise RuntimeError(f"sandbox: no system call table for {machine} (the filter that keeps executions from "
                           f"signalling or tracing other processes knows {sorted(DENIED_SYSCALLS)})")
    if isolation != "process":
        ok, why = namespaces_available()
        if ok:
            if shares_process_budget("namespaces"):
                log.warning("sandbox: isolation=namespaces: %s", _shared_budget("namespaces"))
            return "namespaces"
        if isolation == "namespaces":
            raise RuntimeError(f"sandbox.isolation=namespaces is not available on this node: {why}")
        log.warning("sandbox: namespaces unavailable (%s); falling back to isolation=process", why)
    log.warning("sandbox: %s", process_mode_limits())
    return "process"


def _who() -> str:
    return "nobody" if users() == "nobody" else f"this worker's user (uid {os.geteuid()})"


def _shared_budget(mode: str) -> str:
    """What ``limits.processes`` means where the executions' uid is shared."""
    kernel = "" if mode == "process" else f" (Linux {os.uname().release} counts them per uid, not per user namespace)"
    worker = ", this worker's and its job's included" if users() == "worker" else ""
    return (f"limits.processes is not per execution: RLIMIT_NPROC counts every process and thread of "
            f"{_who()} on the node{worker}{kernel}, so an execution may start limits.processes more than "
            "are running when it starts, and the executions running at the same time draw from that one budget "
            "(a fork bomb in one can refuse another's fork)")


def process_mode_limits() -> str:
    """What the ``process`` mode contains on this node, and what it leaves open."""
    own = users() == "own"
    who = f"a uid of their own each ({UID_BASE}+, no account's)" if own else _who()
    may = "any user" if own else who
    if own:
        who += ", so that limits.processes counts each one's own processes,"
    common = (f"isolation=process: executions run as {who} with resource limits, a timeout and a scrubbed "
              "environment, cannot signal, trace or re-limit any other process, and open no socket but AF_UNIX "
              "ones (no network, io_uring refused)")
    budget = "" if own else f"; {_shared_budget('process')}"
    abi = landlock_abi()
    if abi:
        dirs = ", ".join(d for d in OWN_DIRS if d != ".")
        return (f"{common}; they open files only in their own directory and {dirs}, the device files in /dev "
                f"and, read-only, the interpreter's, {', '.join(READ_ONLY_DIRS)}, /proc and /sys (Landlock ABI {abi}); NOT isolated: "
                f"the file system beneath those directories (whatever {may} may read or write there: keep data "
                f"sets and run directories elsewhere), AF_UNIX sockets {may} may connect to, and the node's "
                f"processes (visible in /proc){budget}")
    return (f"{common}; NOT isolated: the file system (this kernel has no Landlock: an execution reads and writes "
            f"whatever {may} may: " + ("this user's files, the run directory and the data set included"
                                       if users() == "worker" else "world-readable and world-writable files") +
            f"), AF_UNIX sockets {may} may connect to, and the node's processes (visible in /proc){budget}")


def guard_worker() -> None:
    """In process mode where executions share the worker's uid (a worker that is not root): make the
    worker non-dumpable so that they cannot open its ``/proc/<pid>/mem`` or ``fd`` (signals and
    ptrace are refused by the executions' own filter)."""
    if runs_as_other_user():
        return
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")


@functools.lru_cache(maxsize=1)
def _harness_source() -> str:
    """Passed with ``-c``: the child needs no read access to this installation."""
    with open(HARNESS, encoding="utf-8") as f:
        return f.read()


def command(mode: str) -> list[str]:
    """The command that runs the harness under ``mode`` (as the user ``Lease.popen_kwargs`` gives)."""
    python = [interpreter(mode), "-I", "-S", "-c", _harness_source()]
    if mode == "namespaces":
        return [shutil.which("unshare") or "unshare", *NAMESPACE_FLAGS, *python]
    return python


SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment an execution sees (no Slurm, MPI, proxy or token variables)."""
