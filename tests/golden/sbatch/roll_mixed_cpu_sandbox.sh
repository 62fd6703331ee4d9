#!/bin/bash

# Parameters
#SBATCH --account=proj1
#SBATCH --cpus-per-task=4
#SBATCH --gres=gpu:8
#SBATCH --job-name=rlbatch
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=13
#SBATCH --open-mode=append
#SBATCH --output=/shared/runs/example/slurm/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup
export MPIR_CVAR_NOLOCAL=1
export RLBATCH_RUN_DIR=/shared/runs/example
exec {RLBATCH_LOCK_FD}<>/shared/runs/example/rlbatch.lock || exit 1
PYTHON -m rlbatch.launch.joblock /shared/runs/example "$RLBATCH_LOCK_FD" || exit $?

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /shared/runs/example/slurm/%j_%t_log.out --mpi=pmi2 --kill-on-bad-exit=1 PYTHON -u -m submitit.core._submit /shared/runs/example/slurm


# teardown
PYTHON -m rlbatch.runtime.postmortem /shared/runs/example