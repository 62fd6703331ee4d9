"""cluster=slurm: one sbatch job through submitit; srun starts every rank.

The request comes from the Placement (nodes, tasks per node, gres, cpus per task); every other
cluster option passes through. The submitter prints the job id and the log paths and returns;
``wait=true`` follows the job to its end and returns its exit code.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlbatch.checks.cluster_rules import bad_char, parameter_problems
from rlbatch.checks.validate import ENV_NAME
from rlbatch.errors import ConfigError, ExitCode, report_config_error
from rlbatch.launch.exit_codes import run_exit_code
from rlbatch.launch.joblock import job_lock_lines, refusal_in
from rlbatch.launch.rundir import prepare_run_dir
from rlbatch.placement import Placement
from rlbatch.runtime.env import CPU_DEVICE_ENV, MPI_ENV, network_env
from rlbatch.runtime.postmortem import culprits
from rlbatch.runtime.rundir import RunDir

SUBMITIT_DIR = "slurm"
"""Sub-directory of the run directory for submitit's pickles and the per-task Slurm logs."""


def rank_env(cfg: Any, run_dir: Path) -> dict[str, str]:
    """The environment every rank of a Slurm job gets: MPI's settings, the CPU device's, the
    network interface's (``cluster.network_interface``), ``cluster.env`` and the run directory."""
    c = cfg.cluster
    on_cpu = CPU_DEVICE_ENV if str(c.device) == "cpu" else {}  # compute nodes' GPUs are not visible here
    return (MPI_ENV | on_cpu | network_env(c.network_interface) | {str(k): str(v) for k, v in c.env.items()}
            | {"RLBATCH_RUN_DIR": str(run_dir)})


def export_lines(env: dict[str, str]) -> list[str]:
    """``export`` lines for a shell script (the sbatch script's setup, ``rank_env.sh``): names are
    identifiers, values quoted, and neither may hold a control character (``check`` refuses those
    in the config; this refuses any that reach here another way)."""
    unsafe = [f"export {k!r}: not an environment variable name" for k in env if not ENV_NAME.fullmatch(k)]
    unsafe += [f"export {k}: the value {v!r} contains the control character {ch!r}"
               for k, v in env.items() if (ch := bad_char(v)) is not None]
    if unsafe:
        raise ConfigError(unsafe)
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def sbatch_parameters(cfg: Any, placement: Placement, run_dir: Path) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for this run (also what the dry run renders)."""
    c, s = cfg.cluster, placement.slurm
    python = shlex.quote(sys.executable)
    srun_args = [f"--mpi={c.mpi}", "--kill-on-bad-exit=1"]
    if c.container_image:
        srun_args.append(f"--container-image={c.container_image}")
    if c.container_mounts:
        srun_args.append(f"--container-mounts={c.container_mounts}")
    srun_args += [str(a) for a in c.srun_args]
    # The job takes the run directory's lock before any rank starts, and holds it until it ends.
    setup = [str(line) for line in c.setup] + export_lines(rank_env(cfg, run_dir)) + job_lock_lines(sys.executable, run_dir)
    params: dict[str, Any] = {
        "job_name": c.job_name,
        "partition": c.partition,
        "time": int(c.time_min),
        "nodes": s.nodes,
        "ntasks_per_node": s.ntasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        "gres": f"gpu:{s.gpus_per_node}" if s.gpus_per_node else None,
        "account": c.account,
        "qos": c.qos,
        "constraint": c.constraint,
        "mem": f"{c.mem_gb}GB" if c.mem_gb else None,
        "setup": setup,
        "srun_args": srun_args,
        "stderr_to_stdout": True,
        "teardown": [f"{python} -m rlbatch.runtime.postmortem {shlex.quote(str(run_dir))}"],
        # Slurm sends preempt_signal to every task signal_delay_s before the time limit; the run
        # saves, requeues itself, and resumes in the same run_dir.
        "additional_parameters": {"signal": f"{c.preempt_signal}@{int(c.signal_delay_s)}", "requeue": True}
        | dict(c.sbatch_args),
    }
    params = {k: v for k, v in params.items() if v is not None}
    if problems := parameter_problems(params, run_dir):  # check() refuses these first; this is the writer's own guard
        raise ConfigError(problems)
    return params


def submitit_command(run_dir: Path) -> str:
    """The command srun runs in every task (submitit's own entry point)."""
    return f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(run_dir / SUBMITIT_DIR))}"


def sbatch_script(cfg: Any, placement: Placement, run_dir: Path) -> str:
    """The exact sbatch script ``submit`` hands to sbatch."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = sbatch_parameters(cfg, placement, run_dir)
    return _make_sbatch_string(command=submitit_command(run_dir), folder=run_dir / SUBMITIT_DIR, **params)


def sbatch_refusal(stderr: str) -> str:
    """sbatch's own reason for refusing a job, on one line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    reasons = [ln.split("error:", 1)[1].strip() if "error:" in ln else ln for ln in lines]
    return "; ".join(dict.fromkeys(reasons)) or "no reason given"


def submit(cfg: Any, placement: Placement) -> int:
    import submitit
    from submitit.core.utils import FailedJobError

    from rlbatch.worker import main as worker_main

    try:  # the writer's own guard, before the run directory is made (check() refuses these first)
        sbatch_parameters(cfg, placement, Path(str(cfg.run_dir)).expanduser().resolve())
    except ConfigError as e:
        return report_config_error(e)
    run = prepare_run_dir(cfg, placement)
    folder = run.path / SUBMITIT_DIR
    before = set(folder.iterdir()) if folder.is_dir() else set()
    try:
        executor = submitit.SlurmExecutor(folder=folder)
    except RuntimeError as e:  # submitit checks for srun first
        print(f"rlbatch: cannot submit to Slurm here: {e}; nothing was submitted", file=sys.stderr)
        return 2
    executor.update_parameters(**sbatch_parameters(cfg, placement, run.path))
    assert run.lock is not None
    run.lock.submitting()  # the job may start before the hand-over below: it waits for it
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's stderr before raising
            job = executor.submit(worker_main, str(run.path))
    except (FailedJobError, FileNotFoundError) as e:
        for path in set(folder.iterdir()) - before:  # the pickle and script of the refused submission
            path.unlink(missing_ok=True)
        if not before:
            with contextlib.suppress(OSError):
                folder.rmdir()
        why = f"sbatch refused the job: {sbatch_refusal(str(e))}" if isinstance(e, FailedJobError) else f"cannot run sbatch: {e}"
        print(f"rlbatch: {why}; nothing was submitted", file=sys.stderr)
        return 2
    log = folder / f"{job.job_id}_0_log.out"
    run.lock.hand_over(str(job.job_id))  # a later launch asks Slurm whether this job still holds the run_dir
    print(f"submitted Slurm job {job.job_id}: {placement.world_size} processes on {placement.num_nodes} node(s)")
    print(f"  run_dir:  {run.path}")
    print(f"  job log:  {log}  (the controller logs a line per step there: tail -f {log})")
    print(f"  rank logs: {run.logs}/rank<r>.log")
    if not cfg.wait:
        return 0
    return follow(str(job.job_id), run, placement)


def _squeue(job_id: str) -> tuple[str, str]:
    """The job's state and batch host while it is queued or running; ('', '') once it has left."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %B"], capture_output=True, text=True)
    state, _, host = out.stdout.strip().partition(" ")
    return state, host


def _scontrol(job_id: str) -> dict[str, str]:
    """The job's record (JobState, Reason, BatchHost, ...) while slurmctld still keeps it."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)


def follow(job_id: str, run: RunDir, placement: Placement, poll_s: float = 2.0) -> int:
    """Wait for the job to leave the queue; returns the launcher's exit code (``ExitCode``): 0 when
    every rank exited cleanly after the last step, 3 or 4 when the run stopped early with a
    checkpoint and was not requeued (the controller's status file says which), 2 when the job
    refused to start because another run held the run directory (``rlbatch.launch.joblock``)."""
    last, host = None, ""
    try:
        while (seen := _squeue(job_id))[0]:
            state, host = seen[0], seen[1] if seen[1] not in ("", "n/a", "(null)") else host
            if state != last:
                print(f"job {job_id}: {state}", flush=True)
                last = state
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print(f"\nrlbatch: stopped following job {job_id}; it keeps running (scancel --signal=INT {job_id} stops it "
              f"after the step in progress, with a checkpoint)", file=sys.stderr)
        return int(ExitCode.STOPPED_NOW)
    log = run.path / SUBMITIT_DIR / f"{job_id}_0_log.out"
    if refused := refusal_in(log, job_id):  # another run held the run directory: its status files are not ours
        print(f"job {job_id}: refused\n  {refused.removeprefix('rlbatch: ')}", file=sys.stderr)
        return int(ExitCode.BAD_CONFIG)
    states = [run.read_status(r) for r in range(placement.world_size)]
    if all(st is not None and st["state"] == "exited" for st in states):
        code = run_exit_code(True, states[placement.controller_rank], stopped_now=False)
        print(f"job {job_id}: " + ("completed" if code == ExitCode.FINISHED else f"{code.name.lower()} after saving a "
                                   f"checkpoint (exit code {int(code)}); launch again with run_dir={run.path} to resume"))
        return int(code)
    print(f"job {job_id}: failed", file=sys.stderr)
    if all(st is None for st in states) and not log.exists():
        record = _scontrol(job_id)
        if record.get("JobState") == "CANCELLED":
            print(f"  cancelled before any rank started ({record.get('Reason', '?')})", file=sys.stderr)
            return 1
        # Slurm could not open the job log, so nothing of the job ran: the run directory is not there.
        node = record.get("BatchHost") or host or "the job's first node"
        print(f"  run directory {run.path} missing on node {node}: Slurm could not write the job log there, "
              f"so no rank started; put run_dir on a filesystem every node sees", file=sys.stderr)
        return 1
    for line in culprits(placement, run):
        print(f"  {line}", file=sys.stderr)
    return 1
