"""How a run's end maps to the launcher's exit code (``rlbatch.errors.ExitCode``, what
``python -m rlbatch.launch`` returns).

The README's "Exit codes" table lists the codes; ``tests/unit/test_exit_codes.py`` keeps the
two in step. A run that stopped early with a checkpoint returns its own code (never 0), so a
script or a workflow engine can tell "finished" from "stopped, launch again to resume".

Ranks do not carry these codes: a rank that stopped and saved exits 0 (under sbatch a non-zero
job step would make Slurm count the job failed while it has just requeued itself). How the run
ended is in the controller's status file (``logs/rank<r>.status``: ``state``, and ``stopped``
when it stopped early), which the launcher maps here.
"""

from __future__ import annotations

from typing import Any

from rlbatch.errors import ExitCode

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
