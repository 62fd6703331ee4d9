#!/bin/bash

# Parameters
#SBATCH --account=proj.ml-1
#SBATCH --comment='it'"'"'s $USER'"'"'s run'
#SBATCH --constraint='[a100|h100]&ib'
#SBATCH --cpus-per-task=4
#SBATCH --exclusive
#SBATCH --gres=gpu:2
#SBATCH --job-name='grpo run #3 $HOME'
#SBATCH --mail-type=END,FAIL
#SBATCH --mem=64GB
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --open-mode=append
#SBATCH --output='/shared/runs/it'"'"'s my run/slurm/%j_0_log.out'
#SBATCH --partition=gpu,gpu-long
#SBATCH --qos=high_prio
#SBATCH --requeue
#SBATCH --signal=TERM@300
#SBATCH --time=90
#SBATCH --wckey=submitit

# setup
module load cuda/12.4
source "/shared/venvs/my env/bin/activate"
if [ -n "$SLURM_JOB_ID" ]; then
  echo "job $SLURM_JOB_ID"
fi
export MPIR_CVAR_NOLOCAL=1
export NCCL_SOCKET_IFNAME=ib0
export GLOO_SOCKET_IFNAME=ib0
export WANDB_NOTES='it'"'"'s "$HOME" `x` $(id)'
export RLBATCH_RUN_DIR='/shared/runs/it'"'"'s my run'
exec {RLBATCH_LOCK_FD}<>'/shared/runs/it'"'"'s my run/rlbatch.lock' || exit 1
PYTHON -m rlbatch.launch.joblock '/shared/runs/it'"'"'s my run' "$RLBATCH_LOCK_FD" || exit $?

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output '/shared/runs/it'"'"'s my run/slurm/%j_%t_log.out' --mpi=pmix --kill-on-bad-exit=1 '--container-image=/shared/images/my image.sqsh' '--container-mounts=/data/my data:/data,/scratch:/scratch' --cpu-bind=none --export=ALL PYTHON -u -m submitit.core._submit '/shared/runs/it'"'"'s my run/slurm'


# teardown
PYTHON -m rlbatch.runtime.postmortem '/shared/runs/it'"'"'s my run'