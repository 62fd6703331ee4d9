"""The run directory: its layout, shared by the launcher (writes: ``rlbatch.launch.rundir``) and the
ranks (read), and its lock.

    <run_dir>/config.yaml        the resolved config the run was started with
    <run_dir>/placement.json     the Placement, computed once by the launcher
    <run_dir>/logs/rank<r>.log   each rank's output
    <run_dir>/logs/rank<r>.status  JSON: running / exited / failed / terminated, pid, host, roles
    <run_dir>/logs/missing_run_dir.json  JSON {node: host}: nodes the post-mortem found without
                                 the run directory (their ranks could not start)
    <run_dir>/rlbatch.lock       the run directory's lock: who holds it (host, pid, Slurm job id)

One run per run directory: the launcher's ``prepare_run_dir`` takes the lock (``lock_run_dir``,
below) before it writes anything, so a second launch into a directory in use is refused, naming the
holder, before it touches the first run's files. A Slurm job takes it again when it starts, for its
whole life (``rlbatch.launch.joblock``).

Writes that record a rank's state must not fail the error path that makes them: on a full disk
``write_status`` falls back to rewriting the existing status file in place (its block is already
allocated), and gives up quietly when even that fails.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from rlbatch.errors import ConfigError
from rlbatch.osinfo import process_cmdline

CONFIG = "config.yaml"
PLACEMENT = "placement.json"
LOGS = "logs"


@dataclass(frozen=True)
class RunDir:
    path: Path
    lock: RunDirLock | None = field(default=None, compare=False)
    """The directory's lock, where this process took it (the launcher)."""

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def placement(self) -> Path:
        return self.path / PLACEMENT

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_status(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.status"

    @property
    def missing_on(self) -> Path:
        return self.logs / "missing_run_dir.json"

    def read_missing_on(self) -> dict[int, str]:
        """Node index -> host of the nodes found without this run directory (empty if none)."""
        try:
            return {int(n): str(h) for n, h in json.loads(self.missing_on.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def write_status(self, rank: int, state: str, **extra: object) -> bool:
        """Record a rank's state; written atomically so a reader never sees half a file.

        Never raises OSError: it runs on error paths. On a full disk (ENOSPC, EDQUOT) the existing
        file is rewritten in place instead, within the block it already has (a reader may then
        catch it half-written and report the rank as unknown). Returns whether the record landed."""
        rec = {"rank": rank, "state": state, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()} | extra
        data = json.dumps(rec)
        final = self.rank_status(rank)
        tmp = final.with_suffix(".status.tmp")
        try:
            tmp.write_text(data)
            os.replace(tmp, final)
            return True
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return full and _rewrite_in_place(final, data.encode())

    def read_status(self, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.rank_status(rank).read_text())
        except (OSError, ValueError):
            return None


IN_PLACE_MAX = 4096
"""The most a status record rewritten in place may hold: one filesystem block, already allocated."""


def _rewrite_in_place(path: Path, data: bytes) -> bool:
    """Overwrite an existing file from its start without allocating (no O_CREAT/O_TRUNC/O_APPEND);
    the record is cut to IN_PLACE_MAX bytes and the file to its length."""
    if len(data) > IN_PLACE_MAX:
        cut = json.loads(data)
        cut["error"] = str(cut.get("error", ""))[: IN_PLACE_MAX // 2]
        data = json.dumps(cut).encode()[:IN_PLACE_MAX]
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return False
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# -- the lock -------------------------------------------------------------------------------------
LOCK = "rlbatch.lock"
SQUEUE_TIMEOUT_S = 30.0


class RunDirBusy(ConfigError):
    """Another run holds the run directory; the message names it and what to do."""

    def __init__(self, problems: str | list[str], record: LockRecord | None = None, held: bool = False) -> None:
        super().__init__(problems)
        self.record: LockRecord = record if record is not None else {}
        """The holder's record, as the lock file had it."""
        self.held = held
        """The kernel's lock is held by a live process (else the record alone refused)."""


class LockRecord(TypedDict, total=False):
    """The lock file's record of its holder (``holder_record``); empty when the directory is free."""

    host: str
    pid: int | None
    """None once handed over to a Slurm job (``RunDirLock.hand_over``)."""
    slurm_job: str | None
    since: float
    submitting: bool
    """Set by a submitter between sbatch and ``hand_over``: the job it submits may already start."""


def holder_text(rec: LockRecord) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(rec.get("since", 0))))
    if rec.get("pid") is None and rec.get("slurm_job"):  # handed over to the job by its submitter
        return f"Slurm job {rec['slurm_job']} (submitted from host {rec.get('host', '?')}), since {since}"
    job = f", Slurm job {rec['slurm_job']}" if rec.get("slurm_job") else ""
    return f"pid {rec.get('pid', '?')} on host {rec.get('host', '?')}{job}, since {since}"


ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                   "OUT_OF_MEMORY"})
"""Slurm job states after which a job no longer runs (``squeue -j`` lists them for MinJobAge)."""


def _slurm_job_state(job: str) -> str | None:
    """The Slurm job's state while it is queued or running ('' once it has ended or left the
    queue); None when Slurm cannot be asked from here."""
    import subprocess

    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                             timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return "" if "Invalid job id" in out.stderr else None
    state = out.stdout.strip().split(" ")[0] if out.stdout.strip() else ""
    return "" if state in ENDED else state


_HELD: dict[Path, RunDirLock] = {}
"""The run directories this process holds, by lock file."""


class RunDirLock:
    """The lock of one run directory, held by this process through an open file.

    The kernel's lock (``flock``) is the authority: it is released when its holder dies, however
    it dies, so a dead run never blocks the next. The file also holds a record of the holder
    (host, pid, Slurm job id), for the refusal's message and for what the kernel cannot tell
    (``lock_run_dir``). ``release`` (also at exit) empties the record; ``hand_over`` leaves it
    naming a Slurm job that goes on after this process ends.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def write(self, rec: LockRecord) -> None:
        data = json.dumps(rec).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    def submitting(self) -> None:
        """Mark the record while this process submits a Slurm job: the job, started before the
        hand-over, waits for it instead of refusing (``rlbatch.launch.joblock``)."""
        self.write(_read_record(self.fd) | {"submitting": True})

    def hand_over(self, slurm_job: str) -> None:
        """The run goes on as Slurm job ``slurm_job``: record it as the holder and let go of the
        kernel's lock (a later launch asks Slurm whether the job is still queued or running)."""
        self.write(holder_record(slurm_job) | {"pid": None})
        self._close()

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)  # an empty record: free
        except OSError:
            pass
        self._close()

    def _close(self) -> None:
        import atexit

        atexit.unregister(self.release)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)  # the kernel's lock goes with the last descriptor


def holder_record(slurm_job: str | None) -> LockRecord:
    """This process as the holder: its host and pid, its Slurm job, now."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": slurm_job, "since": time.time()}


def _read_record(fd: int) -> LockRecord:
    """The record in the lock file (as ``RunDirLock.write`` wrote it); empty when there is none, it
    cannot be read or it is no JSON object."""
    try:
        data = os.pread(fd, 1 << 16, 0)
        rec: LockRecord = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _busy(path: Path, rec: LockRecord, why: str, held: bool = False) -> RunDirBusy:
    return RunDirBusy(
        f"run_dir {path.parent} is in use by another run: {holder_text(rec)}{why}. Wait for that run to end, "
        f"stop it, or choose another run_dir (nothing of it was touched)", rec, held)


def _stale_or_busy(path: Path, rec: LockRecord, slurm_job: str | None) -> RunDirBusy | None:
    """With the kernel's lock granted, judge the record a previous holder left: None when it is
    stale (that holder is gone), else the refusal.

    A process on this host that held the lock is gone: one host, one kernel. A Slurm job the
    lock was handed to holds no kernel lock: Slurm says whether it is still queued or running.
    Across hosts the kernel's lock is only as good as the filesystem's (NFS shares flock; Lustre
    only when mounted with ``-o flock``; some filesystems keep locks per node), so a process on
    another host is taken to be alive."""
    if not rec:
        return None
    job = rec.get("slurm_job")
    if rec.get("pid") is not None and rec.get("host") == socket.gethostname():
        return None
    if job and slurm_job and str(job) == str(slurm_job):
        return None  # this job's previous incarnation (before a requeue): Slurm has ended it
    if job:
        state = _slurm_job_state(str(job))
        if state == "":
            return None
        what = f" (Slurm reports the job {state})" if state else " (Slurm cannot be asked from here whether it still runs)"
        return _busy(path, rec, what)
    return _busy(path, rec, f"; this host's lock on the file is free, but locks may not be shared between hosts on "
                            f"this filesystem: if that run has ended, delete {path}")


def _ranks_still_running(path: Path) -> RunDirBusy | None:
    """The refusal when ranks of an earlier launch still run on this host: their launcher, the
    lock's holder, was killed (SIGKILL) while mpiexec and the ranks went on (they end at their
    next write to the console, but may not have yet)."""
    run = RunDir(path.parent)
    alive: list[tuple[int, int]] = []  # (rank, pid) from the status files
    for status in sorted(run.logs.glob("rank*.status")):
        st = run.read_status(int(status.stem.removeprefix("rank"))) if status.stem[4:].isdigit() else None
        if not st or st.get("state") != "running" or st.get("host") != socket.gethostname():
            continue
        cmdline = process_cmdline(st["pid"]) if "pid" in st else None
        if cmdline and "rlbatch.worker" in cmdline and str(path.parent) in cmdline:
            alive.append((st["rank"], st["pid"]))
    if not alive:
        return None
    ranks = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in alive)
    return RunDirBusy(f"run_dir {path.parent} is in use by another run: its launcher is gone, but "
                      f"{ranks} still run on this host. Wait for them to end, or stop them "
                      f"(kill {' '.join(str(pid) for _, pid in alive)}), or choose another run_dir")


NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP})
"""flock's errors on a filesystem without locks (Lustre mounted without -o flock)."""


def take_lock(fd: int, path: Path, slurm_job: str | None) -> None:
    """Take the kernel's lock on ``fd`` (the open lock file ``path``) and judge the record a
    previous holder left, or raise RunDirBusy with the kernel's lock not taken.

    ``slurm_job``: the Slurm job the taker belongs to (None outside an allocation); a record left
    by the same job (its previous incarnation, before a requeue) does not block it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(path, _read_record(fd), "", held=True) from None
    except OSError as e:  # no locks on this filesystem: the record alone
        if e.errno not in NO_LOCKS:
            raise
        rec = _read_record(fd)
        if rec.get("host") == socket.gethostname() and _alive(rec.get("pid")):
            raise _busy(path, rec, " (this filesystem has no locks: the record says so)") from None
        if problem := _stale_or_busy(path, rec, slurm_job):
            raise problem from None
        return
    if problem := _stale_or_busy(path, _read_record(fd), slurm_job) or _ranks_still_running(path):
        fcntl.flock(fd, fcntl.LOCK_UN)  # the descriptor may outlive this call (a job's batch shell holds it)
        raise problem


def lock_run_dir(run_dir: Path, slurm_job: str | None = None) -> RunDirLock:
    """Take ``<run_dir>/rlbatch.lock`` for this process (until it exits), or raise RunDirBusy.

    ``slurm_job``: the Slurm job this process belongs to (None outside an allocation); a record
    left by the same job (its previous incarnation, before a requeue) does not block it."""
    import atexit

    path = Path(run_dir) / LOCK
    if (held := _HELD.get(path)) is not None and held.fd >= 0:  # this process's already (a second launch call)
        return held
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        take_lock(fd, path, slurm_job)
    except BaseException:
        os.close(fd)
        raise
    lock = RunDirLock(path, fd)
    lock.write(holder_record(slurm_job))
    atexit.register(lock.release)
    _HELD[path] = lock
    return lock


def _alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
