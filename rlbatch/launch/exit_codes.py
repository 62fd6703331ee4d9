"""The launcher's exit codes, in one place: what ``python -m rlbatch.launch`` returns.

The README's "Exit codes" table lists the same codes; ``tests/unit/test_exit_codes.py`` keeps the
two in step. A run that stopped early with a checkpoint returns its own code (never 0), so a
script or a workflow engine can tell "finished" from "stopped, launch again to resume".

Ranks do not carry these codes: a rank that stopped and saved exits 0 (under sbatch a non-zero
job step would make Slurm count the job failed while it has just requeued itself). How the run
ended is in the controller's status file (``logs/rank<r>.status``: ``state``, and ``stopped``
when it stopped early), which the launcher maps here.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    FINISHED = 0
    """Every step ran (or nothing was to run: a dry run, a submitted job)."""
    FAILED = 1
    """The run failed after it started; the console names the ranks that caused it."""
    BAD_CONFIG = 2
    """The configuration cannot run (every problem printed), or sbatch refused the job: nothing started."""
    PREEMPTED = 3
    """Stopped by the preemption signal (cluster.preempt_signal) or before the walltime, after saving a
    checkpoint; launching again with the same run_dir resumes (resume=auto)."""
    INTERRUPTED = 4
    """Stopped on request after the step in progress, with a checkpoint of it (Ctrl-C or SIGTERM to
    the launcher; ``scancel --signal=INT`` under Slurm); launching again with the same run_dir resumes."""
    STOPPED_NOW = 130
    """Stopped by Ctrl-C without saving: a second Ctrl-C (or SIGTERM) ended every rank of a local run,
    or Ctrl-C came before anything started, or while following a Slurm job (which keeps running).
    130 = 128 + SIGINT, what shells report for a program ended by Ctrl-C."""


STOPPED: dict[str, ExitCode] = {"preempted": ExitCode.PREEMPTED, "interrupted": ExitCode.INTERRUPTED}
"""The ``stopped`` field of the controller's status file -> the launcher's exit code."""


def run_exit_code(ended_cleanly: bool, controller_status: dict[str, Any] | None, stopped_now: bool) -> ExitCode:
    """The exit code of a run whose processes have all ended.

    ``ended_cleanly``: every rank exited 0 (mpiexec's code was 0, or every status file says
    "exited"); ``controller_status``: the controller's status record; ``stopped_now``: the
    launcher ended the ranks itself (a second Ctrl-C).
    """
    if ended_cleanly:
        stopped = (controller_status or {}).get("stopped")
        return STOPPED.get(str(stopped), ExitCode.FAILED) if stopped else ExitCode.FINISHED
    return ExitCode.STOPPED_NOW if stopped_now else ExitCode.FAILED
