#!/bin/bash
# One trainer rank under srun (launch/slurm_train.sbatch starts one task per rank): torch.distributed's env://
# variables from Slurm's task variables, then exec the command, so Slurm's signals reach the Python process
# itself. MASTER_ADDR, MASTER_PORT and LOCAL_WORLD_SIZE come from the batch script's environment.
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID GROUP_RANK=$SLURM_NODEID
# Distributed weight sync: the rollout servers connect back to this node's address on the cluster interface.
if [ -z "${SAPO_WEIGHT_SYNC_ADDR:-}" ] && [ -n "${SAPO_BIND_IFNAME:-}" ]; then
  SAPO_WEIGHT_SYNC_ADDR=$(ip -4 -o addr show dev "$SAPO_BIND_IFNAME" | awk '{split($4, a, "/"); print a[1]; exit}')
  export SAPO_WEIGHT_SYNC_ADDR
fi
exec "$@"
