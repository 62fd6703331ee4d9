"""Prepare a run directory inside an allocation you made yourself (no submitit):

    RUN_DIR=$(python -m rlbatch.launch.prepare cluster=slurm run_dir=$PWD/runs/$SLURM_JOB_ID [overrides])
    exec {RLBATCH_LOCK_FD}<>"$RUN_DIR/rlbatch.lock"
    python -m rlbatch.launch.joblock "$RUN_DIR" "$RLBATCH_LOCK_FD" || exit $?
    source "$RUN_DIR/rank_env.sh"
    srun --mpi=pmi2 --kill-on-bad-exit=1 python -u -m rlbatch.worker "$RUN_DIR"

Validates the config, writes config.yaml and placement.json, checks that the allocation has the
nodes and tasks the placement needs, writes ``rank_env.sh`` (the export lines of the environment
every rank gets, as the submitit launcher's sbatch script has them: ``cluster.env``,
``cluster.network_interface``, MPI's settings), and prints the run directory (only that, on
stdout). The run directory's lock is handed to the job; the two lines after it take it for the
job's whole life (the shell that runs them holds it: ``rlbatch.launch.joblock``). Exit code 2 on
a bad config, a run directory another run holds, or an allocation that does not fit; the values of
``rank_env.sh`` are quoted, and one that would not stay on its line (a control character) is a
bad config (``rlbatch.checks.cluster_rules``).
"""

from __future__ import annotations

import sys

from rlbatch.errors import ConfigError, report_config_error

RANK_ENV = "rank_env.sh"
"""File in the run directory with the ranks' environment, for the sbatch script to source."""


def check_allocation(nodes: int | None, ntasks: int | None, need_nodes: int, need_tasks: int) -> None:
    problems = []
    if nodes is not None and nodes != need_nodes:
        problems.append(f"allocation: the job has {nodes} node(s), the placement needs exactly {need_nodes}")
    if ntasks is not None and ntasks != need_tasks:
        problems.append(f"allocation: the job has {ntasks} task(s), the placement needs {need_tasks} (ntasks-per-node x nodes)")
    if problems:
        raise ConfigError(problems)


def main(argv: list[str]) -> int:
    import os

    from rlbatch.checks.preflight import preflight
    from rlbatch.checks.validate import check
    from rlbatch.config.compose import compose
    from rlbatch.launch.rundir import prepare_run_dir
    from rlbatch.launch.slurm import export_lines, rank_env
    from rlbatch.runtime.env import read_env

    try:
        cfg = compose(argv)
        placement = check(cfg)
        preflight(cfg)
        env_nodes = os.environ.get("SLURM_JOB_NUM_NODES")
        env_tasks = os.environ.get("SLURM_NTASKS")
        check_allocation(int(env_nodes) if env_nodes else None, int(env_tasks) if env_tasks else None,
                         placement.slurm.nodes, placement.slurm.ntasks)
    except ConfigError as e:
        return report_config_error(e)
    try:
        run = prepare_run_dir(cfg, placement)  # refused when another run holds the run directory
    except ConfigError as e:
        return report_config_error(e)
    try:
        lines = export_lines(rank_env(cfg, run.path))  # refuses a value that would not stay on its line
    except ConfigError as e:
        return report_config_error(e)
    (run.path / RANK_ENV).write_text("\n".join(lines) + "\n")
    if run.lock is not None and (job := read_env().job_id):
        run.lock.hand_over(job)  # the run directory is this job's until it leaves the queue
    print(run.path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
