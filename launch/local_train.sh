#!/bin/bash
# Local (one machine) run: the CLI itself starts launch.procs_per_node processes under torchrun when > 1.
#   launch/local_train.sh [CONFIG] [--output-dir DIR] [--set KEY=VALUE ...]
set -euo pipefail
exec "${SAPO_MEGATRON:-sapo-megatron}" train "$@"
