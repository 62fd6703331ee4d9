"""Every process of a run: ``python -m rlbatch.worker <run_dir>``.

Started by mpiexec (cluster=local), by srun through submitit (cluster=slurm), or by srun from a
hand-written sbatch file (slurm/rlbatch.sbatch). Reads the config and Placement the launcher
wrote into the run directory, finds its own slot, builds the world, and runs its part of the
program: the controller loop on the controller, the command server everywhere else.

Any failure is recorded in logs/rank<r>.status, printed on the console with the rank and its
roles, and ends the whole job (MPI_Abort): no rank is left waiting.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

PROGRAMS = {
    "train": "rlbatch.loop.program",
    "eval": "rlbatch.loop.evaluate_only",
    "selftest": "rlbatch.runtime.selftest",
}
"""cfg.program -> module with controller(world, cfg, run) and handlers(world, cfg, run)."""


SECONDARY_GRACE_S = 3.0


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _quietly(fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    """Call ``fn`` on the failure path, where a second failure must not stop the abort."""
    try:
        fn(*args, **kwargs)
    except BaseException:  # there is nowhere left to report it
        pass


def main(run_dir: str) -> int:
    from rlbatch.runtime.rundir import RunDir

    run = RunDir(Path(run_dir).resolve())
    if not run.placement.is_file():
        # No status file can be written either: say it where srun shows it, and exit before MPI
        # starts, so srun ends the job at once (--kill-on-bad-exit).
        import socket

        print(f"rlbatch: run directory {run.path} missing on node {socket.gethostname()}: this rank cannot "
              f"start; put run_dir on a filesystem every node sees", file=sys.stderr, flush=True)
        return 1

    from mpi4py import MPI

    from rlbatch.config.load import load_config
    from rlbatch.placement.io import load_placement
    from rlbatch.runtime.env import read_env
    from rlbatch.runtime.lifeline import hold as hold_lifeline
    from rlbatch.runtime.logs import RankLog
    from rlbatch.runtime.postmortem import SECONDARY, describe_rank
    from rlbatch.runtime.world import build_world, identify, shutdown

    placement = load_placement(run.placement)
    cfg = load_config(run.config)
    from rlbatch.loop.preemption import install_handlers

    signal.signal(signal.SIGTERM, _on_sigterm)
    # Before this rank reports itself running: the launcher forwards a stop request (SIGINT) only
    # to a rank that has, and the signal would otherwise end the rank with a traceback.
    install_handlers(str(cfg.cluster.preempt_signal))
    env = read_env()
    slot = identify(placement, env, MPI.COMM_WORLD.Get_rank())
    if slot is None:  # a spare Slurm slot: take part in the communicator split, then leave
        MPI.COMM_WORLD.Split(MPI.UNDEFINED, 0)
        return 0
    rank = slot.world_rank
    hold_lifeline(rank)
    who = describe_rank(placement, rank)
    logs = RankLog(run.rank_log(rank), rank, who, console=slot.kind.value == "controller")
    run.write_status(rank, "running", roles=[r for r, _ in slot.roles])
    log = logging.getLogger("rlbatch.worker")
    try:
        from rlbatch.plugins import import_plugins

        if problems := import_plugins(list(cfg.plugins)):  # they register engines, algorithm parts
            raise ImportError("; ".join(problems))
        c = cfg.cluster
        torch_threads = int(os.environ.get("OMP_NUM_THREADS", c.cpus_per_task))
        import torch

        torch.set_num_threads(max(1, torch_threads))
        world = build_world(placement, env, device=c.device, timeout_s=float(c.timeout_s),
                            port_range=(int(c.port_range[0]), int(c.port_range[1])))
        assert world is not None
        log.info("%s up: device %s, job %s", who, world.device, env.job_id)
        program = importlib.import_module(PROGRAMS[str(cfg.program)])
        outcome: dict[str, str] = {}
        if world.is_controller:
            outcome = program.controller(world, cfg, run) or {}  # how the run ended, for the launcher
        else:
            from rlbatch.runtime.control import serve

            serve(world.comm, placement.controller_rank, program.handlers(world, cfg, run))
        shutdown(world)
        run.write_status(rank, "exited", code=0, **outcome)
    except BaseException as e:
        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
        # Nothing here may raise: on a full disk the status and log writes fail too, and an error
        # escaping this block would skip MPI_Abort and leave every rank waiting in MPI_Finalize.
        if isinstance(e, SystemExit) and code == 128 + signal.SIGTERM:
            _quietly(run.write_status, rank, "terminated", signal="SIGTERM")
        else:
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            _quietly(run.write_status, rank, "failed", error=last, peers=list(getattr(e, "peers", ())))
            _quietly(log.error, "failed:\n%s", traceback.format_exc())
            _quietly(logs.fatal, f"failed: {last} (traceback in {run.rank_log(rank)})")  # the console, not the disk
            if type(e).__name__ in SECONDARY:
                # This failure is a consequence of another rank's. Under srun, --kill-on-bad-exit
                # sends every rank SIGTERM within a moment: wait for it, so that ranks record
                # "terminated" and the rank that died stands out, instead of aborting first.
                time.sleep(SECONDARY_GRACE_S)
        _quietly(sys.stdout.flush)
        MPI.COMM_WORLD.Abort(code or 1)
        os._exit(code or 1)  # MPI_Abort may return before the launcher acts
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rlbatch.worker <run_dir>")
    from rlbatch.runtime import zygote

    if zygote.enabled():  # RLBATCH_FORKSERVER=1: this process stands for a rank forked from the node's zygote
        sys.exit(zygote.stub(sys.argv, "rlbatch.worker:main"))
    sys.exit(main(sys.argv[1]))
