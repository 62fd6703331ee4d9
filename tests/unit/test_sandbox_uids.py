"""Whose uid a sandboxed execution runs as, and what ``limits.processes`` becomes for it.

Under a root worker each execution holds a uid of its own from ``isolation.UID_BASE`` (a lock file
per uid): executions running at the same time, in one worker's threads or in separate workers,
never share one, and a uid whose processes are not all reaped yet is not given out again. Where
the uid is shared (a worker that is not root), the processes it has when an execution starts are
added to that execution's RLIMIT_NPROC. The executions themselves are in test_sandbox_hostile.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from rlbatch.sandbox import isolation

REPO = str(Path(__file__).resolve().parents[2])
OWN = isolation.users() == "own"
needs_own = pytest.mark.skipif(not OWN, reason=f"executions run as {isolation.users()}: a worker that is not root "
                                               "has no uids to give")

HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from rlbatch.sandbox import isolation
    user = isolation.lease()
    print(user.uid, flush=True)
    sys.stdin.read()
    user.release()
    """)


def _in_range(uid: int | None) -> bool:
    return uid is not None and isolation.UID_BASE <= uid < isolation.UID_BASE + isolation.UID_COUNT


@needs_own
def test_workers_on_one_node_never_share_a_uid() -> None:
    """Six worker processes, each holding one lease until told to give it back: six uids."""
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, REPO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(6)]
    try:
        uids = [int(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.communicate("", timeout=120)
    assert all(p.returncode == 0 for p in procs)
    assert len(set(uids)) == len(uids) and all(_in_range(u) for u in uids), uids


@needs_own
def test_threads_of_one_worker_never_share_a_uid() -> None:
    """Sixteen threads leasing at the same moment, all holding theirs until all have one."""
    barrier = threading.Barrier(16, timeout=120)
    got: list[isolation.Lease] = []

    def one() -> None:
        barrier.wait()
        user = isolation.lease()
        got.append(user)
        barrier.wait()

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    uids = [u.uid for u in got]
    for user in got:
        user.release()
    assert len(uids) == 16 and len(set(uids)) == 16 and all(_in_range(u) for u in uids), uids


@needs_own
def test_a_uid_is_given_again_only_once_its_processes_are_gone() -> None:
    """An execution whose (killed) processes are not all reaped keeps its uid out of use until they
    are: the next execution does not start with them counted against it."""
    first = isolation.lease()
    left = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a process group still there
    try:
        first.release(left.pid)
        with isolation.lease() as second:
            assert second.uid != first.uid
            assert any(path == first.path for _, path, _, _ in isolation._SETTLING)
    finally:
        left.kill()
        left.wait()
    with isolation.lease():
        assert not any(path == first.path for _, path, _, _ in isolation._SETTLING)


@needs_own
def test_lock_directory_must_be_roots_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A lock directory that another user made (or may write) is not used: it could hand one uid
    to two executions."""
    squatted, good = tmp_path / "squatted", tmp_path / "good"
    squatted.mkdir()
    os.chown(squatted, isolation.NOBODY, isolation.NOBODY)
    monkeypatch.setattr(isolation, "LOCK_DIRS", (str(squatted), str(good)))
    assert isolation._lock_dir.__wrapped__() == str(good)  # type: ignore[attr-defined]
    monkeypatch.setattr(isolation, "LOCK_DIRS", (str(squatted),))
    with pytest.raises(RuntimeError, match="not a directory of root's alone"):
        isolation._lock_dir.__wrapped__()  # type: ignore[attr-defined]


THREADS = textwrap.dedent("""
    import sys, threading
    stop = threading.Event()
    for _ in range(5):
        threading.Thread(target=stop.wait).start()
    print("up", flush=True)
    sys.stdin.read()
    stop.set()
    """)


@needs_own
def test_tasks_of_counts_threads() -> None:
    """What RLIMIT_NPROC counts: a process with five threads of its own is six tasks."""
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3 to run as another user")
    with isolation.lease() as user:
        proc = subprocess.Popen(["/usr/bin/python3", "-I", "-c", THREADS], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd="/", **user.popen_kwargs())
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "up\n"
            assert isolation.tasks_of(user.counted_uid()) == 6
        finally:
            proc.communicate("", timeout=120)


def test_nproc_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """RLIMIT_NPROC = limits.processes + the harness's own tasks (the judge; under namespaces also
    unshare) + where the uid is shared, the tasks it has when the execution starts; at most the
    worker's hard limit."""
    monkeypatch.setattr(isolation, "tasks_of", lambda uid: 40)
    monkeypatch.setattr(isolation, "counts_per_user_namespace", lambda: True)
    monkeypatch.setattr(isolation, "users", lambda: "own")
    own = isolation.Lease(isolation.UID_BASE, shared=False)
    assert (isolation.nproc_limit("process", 16, own), isolation.nproc_limit("namespaces", 16, own)) == (17, 18)
    monkeypatch.setattr(isolation, "users", lambda: "worker")
    shared = isolation.Lease(None, shared=True)
    assert (isolation.nproc_limit("process", 16, shared), isolation.nproc_limit("namespaces", 16, shared)) == (57, 18)
    monkeypatch.setattr(isolation, "counts_per_user_namespace", lambda: False)  # Linux < 5.14: per uid
    assert isolation.nproc_limit("namespaces", 16, shared) == 58
    monkeypatch.setattr(isolation.resource, "getrlimit", lambda kind: (30, 30))
    assert isolation.nproc_limit("process", 16, shared) == 30


def test_process_mode_warning_says_whose_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "users", lambda: "own")
    text = isolation.process_mode_limits()
    assert f"executions run as a uid of their own each ({isolation.UID_BASE}+" in text, text
    assert "not per execution" not in text, text
    monkeypatch.setattr(isolation, "users", lambda: "worker")
    text = isolation.process_mode_limits()
    assert f"executions run as this worker's user (uid {os.geteuid()})" in text, text
    assert ("limits.processes is not per execution: RLIMIT_NPROC counts every process and thread of this worker's "
            f"user (uid {os.geteuid()}) on the node, this worker's and its job's included") in text, text
