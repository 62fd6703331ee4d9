"""Preemption and walltime: notice that the job must end, so the loop saves and requeues.

Two triggers, checked at every step boundary:
- the preemption signal (cluster.preempt_signal, USR2 by default; Slurm sends it signal_delay_s
  before the time limit through ``sbatch --signal``, and to every task on preemption by
  ``scancel --signal``). Every rank installs the handler so none dies of it; the controller acts.
- a deadline from the job's end time: if the next step plus a checkpoint would end within
  cluster.deadline_margin_s of it, save now, even if no signal comes.

SIGINT is a stop request too: the local launcher forwards Ctrl-C or SIGTERM to the controller as
SIGINT (``rlbatch.launch.interrupt``), and ``scancel --signal=INT`` does the same under Slurm. The
loop saves and stops the same way, but a job that someone asked to stop is not requeued. How
the run stopped ("preempted" or "interrupted") goes into the controller's status file, from
which the launcher takes its exit code (``rlbatch.errors.ExitCode``).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from datetime import datetime

from rlbatch.config.schema import ClusterConfig
from rlbatch.runtime.env import SchedulerEnv

log = logging.getLogger(__name__)
_received: list[str] = []

INTERRUPT_SIGNAL = "INT"
"""The signal that asks a run to stop after the step in progress, save, and not requeue."""


def install_handler(name: str) -> None:
    """Record the signal ``SIG<name>`` instead of dying of it."""
    sig = getattr(signal, f"SIG{name}")
    signal.signal(sig, lambda s, f: _received.append(signal.Signals(s).name))


def install_handlers(preempt_signal: str) -> None:
    """Every rank calls this before it reports itself running (the launcher signals only ranks
    that have): the preemption signal and SIGINT are recorded, and the controller acts on them."""
    for name in dict.fromkeys((preempt_signal, INTERRUPT_SIGNAL)):
        install_handler(name)


def job_end_time(env: SchedulerEnv) -> float | None:
    """Epoch seconds at which Slurm ends this job, or None outside Slurm / without a limit."""
    if env.slurm_job_end:
        return float(env.slurm_job_end)
    if env.job_id is None or not env.under_slurm:
        return None
    out = subprocess.run(["squeue", "-h", "-j", env.job_id, "-o", "%e"], capture_output=True, text=True)
    try:
        return datetime.fromisoformat(out.stdout.strip()).timestamp()
    except ValueError:
        return None  # no time limit (UNLIMITED) or squeue unavailable


class Preemption:
    def __init__(self, cluster: ClusterConfig, env: SchedulerEnv) -> None:
        self.env = env
        self.margin = float(cluster.deadline_margin_s)
        self.end = job_end_time(env)
        self.preempt_signal = f"SIG{cluster.preempt_signal}"
        self.stopped: str | None = None
        """'preempted' or 'interrupted' once reason_to_stop has given a reason (the loop then stops)."""

    def reason_to_stop(self, step_s: float, save_s: float) -> str | None:
        if _received:
            # Someone asking the run to stop outranks a preemption: the job is not requeued.
            interrupt = f"SIG{INTERRUPT_SIGNAL}"
            asked = [s for s in _received if s == interrupt and s != self.preempt_signal]
            self.stopped = "interrupted" if asked else "preempted"
            return f"signal {(asked or _received)[0]}"
        if self.end is not None:
            left = self.end - time.time()
            if left < step_s + save_s + self.margin:
                self.stopped = "preempted"
                return f"deadline: {left:.0f}s left before the time limit, a step takes {step_s:.0f}s"
        return None

    def outcome(self, reason: str | None) -> dict[str, str]:
        """What the controller's status file records about how the loop ended: nothing when it
        ran every step, else ``stopped`` ('preempted' or 'interrupted') and the reason."""
        if reason is None or self.stopped is None:
            return {}
        return {"stopped": self.stopped, "reason": reason}

    def requeue(self) -> bool:
        """Put this Slurm job back in the queue (it restarts in the same run_dir and resumes);
        not when the run was asked to stop."""
        if self.stopped == "interrupted" or not self.env.under_slurm or self.env.job_id is None:
            return False
        out = subprocess.run(["scontrol", "requeue", self.env.job_id], capture_output=True, text=True)
        if out.returncode != 0:
            log.error("scontrol requeue %s failed: %s", self.env.job_id, out.stderr.strip())
            return False
        return True
