"""A Slurm job's side of the run directory's lock: the job takes it when it starts and holds it for
its whole life, so that nothing else shares the run directory while it runs.

The sbatch script (``job_lock_lines``; slurm/rlbatch.sbatch has the same lines) opens the lock file
on a descriptor of its own shell, on the job's first node, and runs

    python -m rlbatch.launch.joblock <run_dir> <fd>

which takes the kernel's lock (``flock``) on that descriptor, writes the record (host, the batch
shell's pid, the job id) and exits. The lock belongs to the open file, which the batch shell keeps
open until the job ends, however it ends (Slurm ends the shell with the job), so no process has to
stay behind to hold it. The ranks start after it (srun), never before.

What the job takes over, and what it refuses (``take_for_job``):

- a record naming this very job: the submitter's hand-over, or this job's earlier incarnation
  before a requeue (Slurm runs one incarnation of a job at a time). If that incarnation's kernel
  lock is still held, the job waits up to ``WAIT_S`` for it to go (a dying batch shell; a
  filesystem that keeps a dead node's lock until its lease runs out, 90 s on NFSv4), then refuses:
  processes of the job still holding the lock past that are processes Slurm has lost track of.
- a record whose holder is gone: a finished Slurm job (``squeue``), a process on this host whose
  kernel lock is free.
- a submitter between sbatch and its hand-over (``RunDirLock.submitting``): the job waits for the
  hand-over, then judges the record it leaves.

Any other live holder (another job queued or running, a local launch's process) refuses the job at
once, before any rank starts and before the job writes anything into the run directory (its own
log aside): the message (on the job log's first lines) names the run directory, the holder and what to do, and the job ends
with exit code 2, the launcher's own code for this refusal (``ExitCode.BAD_CONFIG``).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rlbatch.errors import ExitCode
from rlbatch.runtime.rundir import LOCK, LockRecord, RunDirBusy, RunDirLock, holder_record, holder_text, take_lock

WAIT_S = 180.0
"""How long a starting job waits for a lock it may take over (its own earlier incarnation's, a
submitter's in the middle of handing over): longer than NFSv4's default lease (90 s), after which
the server releases a dead client's locks."""
POLL_S = 0.5

REFUSED = "rlbatch: Slurm job {job} cannot start: "
"""The refusal's first words on the job log (``refusal_in`` finds them there)."""

FD_VAR = "RLBATCH_LOCK_FD"
"""The batch shell's variable holding the descriptor of the lock file."""


def job_lock_lines(python: str, run_dir: Path) -> list[str]:
    """The sbatch script's lines that take the run directory's lock for the job (before srun)."""
    lock, py = shlex.quote(str(run_dir / LOCK)), shlex.quote(python)
    return [f"exec {{{FD_VAR}}}<>{lock} || exit 1",
            f'{py} -m rlbatch.launch.joblock {shlex.quote(str(run_dir))} "${FD_VAR}" || exit $?']


def _worth_waiting(e: RunDirBusy, job: str) -> bool:
    """Whether the holder that refused ``job`` may yet let it in: a submitter between sbatch and its
    hand-over, this job's own earlier incarnation, or a taker that has not written its record yet."""
    rec = e.record
    return bool(rec.get("submitting")) or (e.held and (not rec or str(rec.get("slurm_job")) == job))


def take_for_job(run_dir: Path, fd: int, job: str, wait_s: float = WAIT_S,
                 say: Callable[[str], None] | None = None) -> LockRecord:
    """Take the lock of ``run_dir`` on ``fd`` for Slurm job ``job`` and record the batch shell (this
    process's parent) as its holder; returns the record. Raises RunDirBusy (the kernel's lock not
    taken) when another live holder has it, or when it is still held ``wait_s`` after the job
    started and the holder is one worth waiting for (``_worth_waiting``)."""
    path = Path(run_dir) / LOCK
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            take_lock(fd, path, job)
            break
        except RunDirBusy as e:
            if not _worth_waiting(e, job):
                raise
            if time.monotonic() >= deadline:
                raise _still_held(path, e, job, wait_s) from None
            if not waited and say is not None:
                who = holder_text(e.record) if e.record else "a process that has not written its record yet"
                say(f"rlbatch: Slurm job {job}: run_dir {path.parent} is locked by {who}; "
                    f"waiting up to {wait_s:.0f} s for it to be released")
                waited = True
            time.sleep(POLL_S)
    rec = holder_record(job) | {"pid": os.getppid()}
    RunDirLock(path, fd).write(rec)  # no release at exit: the batch shell's descriptor holds the lock
    return rec


def _still_held(path: Path, e: RunDirBusy, job: str, wait_s: float) -> RunDirBusy:
    """The refusal once a holder worth waiting for (``_worth_waiting``) still has the lock."""
    rec, held = e.record, holder_text(e.record)
    if str(rec.get("slurm_job")) == job:
        host = rec.get("host", "?")
        why = (f"run_dir {path.parent} is still locked by this job's earlier incarnation ({held}) {wait_s:.0f} s "
               f"after Slurm started the job again: processes of job {job} on host {host} still hold {path} (a node "
               f"cut off from Slurm but not from the filesystem), or the filesystem keeps the lock of a node that "
               f"died. Make sure nothing of job {job} still runs on {host}, then requeue it (scontrol requeue {job})")
    elif rec.get("submitting"):
        why = (f"run_dir {path.parent} is held by a launch submitting a Slurm job ({held}), which has not handed it "
               f"to that job after {wait_s:.0f} s. If that launch has ended, delete {path} and submit again; else "
               f"wait for it, or choose another run_dir (nothing of it was touched)")
    else:
        why = (f"run_dir {path.parent} is locked by a process that left no record in {path}, still after "
               f"{wait_s:.0f} s. Stop it (fuser {path} names it, on its host), or choose another run_dir "
               f"(nothing of it was touched)")
    return RunDirBusy(why, rec, e.held)


def refusal_in(log: Path, job: str) -> str | None:
    """The refusal ``job`` wrote on its log (``main``), if it was refused."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    prefix = REFUSED.format(job=job)
    return next((ln for ln in text.splitlines() if ln.startswith(prefix)), None)


def main(argv: list[str]) -> int:
    from rlbatch.runtime.env import read_env

    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m rlbatch.launch.joblock <run_dir> <fd of the open lock file>", file=sys.stderr)
        return int(ExitCode.BAD_CONFIG)
    job = read_env().job_id
    if not job:
        print("rlbatch.launch.joblock: not inside a Slurm job (no SLURM_JOB_ID)", file=sys.stderr)
        return int(ExitCode.BAD_CONFIG)
    run_dir = Path(argv[0]).resolve()

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        take_for_job(run_dir, int(argv[1]), job, say=say)
    except OSError as e:  # the descriptor is not the open lock file, or the filesystem failed
        say(f"rlbatch: Slurm job {job}: cannot lock {run_dir / LOCK} (descriptor {argv[1]}): {e}")
        return int(ExitCode.FAILED)
    except RunDirBusy as e:
        say(REFUSED.format(job=job) + str(e))
        say(f"  no rank was started; the job ends with exit code {int(ExitCode.BAD_CONFIG)}: submit it again once "
            f"run_dir {run_dir} is free")
        return int(ExitCode.BAD_CONFIG)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
