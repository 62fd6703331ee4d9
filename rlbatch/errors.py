"""The one error type for bad configuration, how every entry point reports it, and the exit codes
of ``python -m rlbatch.launch`` (at the bottom of the layers: every entry point returns them)."""

from __future__ import annotations

import sys
from enum import IntEnum


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


class ConfigError(ValueError):
    """A configuration that cannot run. Carries every problem found, one per line.

    Raised before any process starts or any job is submitted. ``problems`` lists each problem
    separately so callers (tests, the dry run) can inspect them; ``str()`` joins them.
    """

    def __init__(self, problems: str | list[str]) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        if not self.problems:
            raise ValueError("ConfigError needs at least one problem")
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the configuration:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(message)


def report_config_error(e: ConfigError) -> int:
    """Print every problem of ``e`` to stderr; returns exit code 2 (bad configuration)."""
    print("rlbatch: the configuration cannot run:", file=sys.stderr)
    for p in e.problems:
        print(f"  - {p}", file=sys.stderr)
    print("nothing was started.", file=sys.stderr)
    return int(ExitCode.BAD_CONFIG)
