#!/bin/bash
# One trainer rank under srun (launch/slurm_train.sbatch starts one task per rank): torch.distributed's env://
# variables from Slurm's task variables, then exec the command, so Slurm's signals reach the Python process
# itself. MASTER_ADDR, MASTER_PORT and LOCAL_WORLD_SIZE come from the batch script's environment.
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID GROUP_RANK=$SLURM_NODEID
exec "$@"
