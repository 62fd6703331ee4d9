"""Which containment this node allows, and the command line that applies it.

Namespaces come from util-linux ``unshare`` (present on every Linux node; no daemon, no setuid
helper): ``--user --map-root-user`` works for an unprivileged user where the kernel allows
unprivileged user namespaces, and for root. The probe runs once per process.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys

from rlbatch.sandbox.harness import DENIED_SYSCALLS, OWN_DIRS, READ_ONLY_DIRS, landlock_abi

log = logging.getLogger(__name__)

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
INTERPRETERS = (os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "/usr/bin/python3")
"""Candidates for the executions' interpreter, in order: this one's base (the harness needs the
standard library only, ``-I -S``), else the system's (as ``nobody``, an interpreter under root's
home cannot be run)."""
NOBODY = 65534
NAMESPACE_FLAGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
                   "--mount-proc", "--ipc", "--uts")


def runs_as_nobody() -> bool:
    """As root (with util-linux ``setpriv``), executions run as ``nobody``, in either mode: root's
    files and processes stay out of their reach, and RLIMIT_NPROC applies."""
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


def _as_nobody() -> list[str]:
    if runs_as_nobody():
        return [shutil.which("setpriv") or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return []


def _runs(cmd: list[str]) -> str:
    """'' when ``cmd`` exits 0, else why not."""
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if proc.returncode == 0 else proc.stderr.decode(errors="replace").strip()[:200] or f"exit {proc.returncode}"


@functools.lru_cache(maxsize=2)
def interpreter(mode: str) -> str:
    """The first interpreter an execution under ``mode`` can start."""
    prefix = [*_as_nobody(), *([shutil.which("unshare") or "unshare", *NAMESPACE_FLAGS] if mode == "namespaces" else [])]
    why = {}
    for python in INTERPRETERS:
        if os.path.exists(python):
            why[python] = _runs([*prefix, python, "-I", "-S", "-c", "pass"])
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
            return "namespaces"
        if isolation == "namespaces":
            raise RuntimeError(f"sandbox.isolation=namespaces is not available on this node: {why}")
        log.warning("sandbox: namespaces unavailable (%s); falling back to isolation=process", why)
    log.warning("sandbox: %s", process_mode_limits())
    return "process"


def process_mode_limits() -> str:
    """What the ``process`` mode contains on this node, and what it leaves open."""
    who = "nobody" if runs_as_nobody() else f"this worker's user (uid {os.geteuid()})"
    common = (f"isolation=process: executions run as {who} with resource limits, a timeout and a scrubbed "
              "environment, cannot signal, trace or re-limit any other process, and open no socket but AF_UNIX "
              "ones (no network, io_uring refused)")
    abi = landlock_abi()
    if abi:
        own = ", ".join(d for d in OWN_DIRS if d != ".")
        return (f"{common}; they open files only in their own directory and {own}, the device files in /dev "
                f"and, read-only, the interpreter's, {', '.join(READ_ONLY_DIRS)}, /proc and /sys (Landlock ABI {abi}); NOT isolated: "
                f"the file system beneath those directories (whatever {who} may read or write there: keep data "
                f"sets and run directories elsewhere), AF_UNIX sockets {who} may connect to, and the node's "
                "processes (visible in /proc)")
    return (f"{common}; NOT isolated: the file system (this kernel has no Landlock: an execution reads and writes "
            f"whatever {who} may: " + ("world-readable and world-writable files" if runs_as_nobody() else
                                        "this user's files, the run directory and the data set included") +
            f"), AF_UNIX sockets {who} may connect to, and the node's processes (visible in /proc)")


def guard_worker() -> None:
    """In process mode as a user other than root, executions share the worker's uid: make the worker
    non-dumpable so that they cannot open its ``/proc/<pid>/mem`` or ``fd`` (signals and ptrace are
    refused by the executions' own filter)."""
    if runs_as_nobody():
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
    """The command that runs the harness under ``mode``."""
    python = [interpreter(mode), "-I", "-S", "-c", _harness_source()]
    if mode == "namespaces":
        return [*_as_nobody(), shutil.which("unshare") or "unshare", *NAMESPACE_FLAGS, *python]
    return [*_as_nobody(), *python]


SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment an execution sees (no Slurm, MPI, proxy or token variables)."""
