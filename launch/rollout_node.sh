#!/bin/bash
# The rollout servers of one node: launch/slurm_rollout.sbatch starts this under srun, one task per node.
#
#   rollout_node.sh [extra server flags]       (settings come from the environment the batch script exports)
#
# Starts SAPO_SERVERS_PER_NODE servers, server i on port SAPO_SGLANG_PORT + i with the i-th slice of
# SAPO_GPUS_PER_SERVER GPUs of this node's CUDA_VISIBLE_DEVICES, all bound to this node's cluster address
# (sapo_node_addr), then writes their URLs to $SAPO_RUN_DIR/workers.<node>. It exits non-zero as soon as one
# server exits (srun --kill-on-bad-exit then stops the other nodes), and on SIGTERM/SIGINT stops its servers
# (by process id: SIGTERM, then SIGKILL after SAPO_STOP_TIMEOUT_S) before exiting.
set -euo pipefail
# shellcheck source=launch/slurm_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/slurm_common.sh"

: "${SAPO_MODEL_PATH:?} ${SAPO_RUN_DIR:?} ${SAPO_SERVERS_PER_NODE:?} ${SAPO_GPUS_PER_SERVER:?} ${SAPO_SGLANG_PORT:?}"
NODE=${SLURMD_NODENAME:-$(hostname -s)}
ADDR=$(sapo_node_addr)
read -r -a SERVER_CMD <<< "${SAPO_SERVER_CMD:-python -m sglang.launch_server}"
# SGLang 0.5.23 keeps each image's vision-tower output (mm_schedule.embedding_cache, SGLANG_VLM_CACHE_SIZE_MB) across
# weight updates – neither flush_cache nor update_weights_* clears it – so a trained vision tower would be served
# stale for every image seen before (docs/multimodal_rl.md). Off unless set; a text model never uses it.
export SGLANG_VLM_CACHE_SIZE_MB="${SGLANG_VLM_CACHE_SIZE_MB:-0}"
API_KEY=""
[ -z "${SAPO_ROLLOUT_KEY_FILE:-}" ] || API_KEY=$(< "$SAPO_ROLLOUT_KEY_FILE")

# The GPUs Slurm gave this node, e.g. "0,1,2,3,4,5,6,7"; server i gets entries [i*g, (i+1)*g).
GPUS=()
if [ "$SAPO_GPUS_PER_SERVER" -gt 0 ]; then
  IFS=, read -r -a GPUS <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((${SLURM_GPUS_ON_NODE:-0} - 1)))}"
  NEEDED=$((SAPO_SERVERS_PER_NODE * SAPO_GPUS_PER_SERVER))
  [ "${#GPUS[@]}" -ge "$NEEDED" ] || sapo_die "$NODE has ${#GPUS[@]} GPU(s) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}); SAPO_SERVERS_PER_NODE=$SAPO_SERVERS_PER_NODE x SAPO_GPUS_PER_SERVER=$SAPO_GPUS_PER_SERVER needs $NEEDED"
fi

PIDS=()
stop_servers() {
  local pid deadline=$(($(date +%s) + ${SAPO_STOP_TIMEOUT_S:-20}))
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2> /dev/null || true; done
  for pid in "${PIDS[@]}"; do
    while kill -0 "$pid" 2> /dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; done
    kill -KILL "$pid" 2> /dev/null || true
  done
  wait 2> /dev/null || true
}
trap 'sapo_log "$NODE: stopping ${#PIDS[@]} server(s)"; stop_servers; exit 143' TERM INT

URLS=()
for ((i = 0; i < SAPO_SERVERS_PER_NODE; i++)); do
  PORT=$((SAPO_SGLANG_PORT + i))
  ARGS=(--model-path "$SAPO_MODEL_PATH" --host "$ADDR" --port "$PORT" --tp-size "$((SAPO_GPUS_PER_SERVER > 0 ? SAPO_GPUS_PER_SERVER : 1))")
  [ -z "$API_KEY" ] || ARGS+=(--api-key "$API_KEY")
  [ "${SAPO_ROUTED_EXPERTS:-0}" != 1 ] || ARGS+=(--enable-return-routed-experts)
  [ -z "${SAPO_QUANTIZATION:-}" ] || ARGS+=(--quantization "$SAPO_QUANTIZATION")
  LOG=$SAPO_RUN_DIR/$NODE-server$i.log
  if [ "$SAPO_GPUS_PER_SERVER" -gt 0 ]; then
    DEVICES=$(IFS=,; echo "${GPUS[*]:$((i * SAPO_GPUS_PER_SERVER)):$SAPO_GPUS_PER_SERVER}")
    CUDA_VISIBLE_DEVICES=$DEVICES "${SERVER_CMD[@]}" "${ARGS[@]}" "$@" > "$LOG" 2>&1 &
  else
    "${SERVER_CMD[@]}" "${ARGS[@]}" "$@" > "$LOG" 2>&1 &
  fi
  PIDS+=($!)
  URLS+=("http://$ADDR:$PORT")
  sapo_log "$NODE: server $i (pid $!) on http://$ADDR:$PORT${DEVICES:+, GPUs $DEVICES}; log $LOG"
done
printf '%s\n' "${URLS[@]}" > "$SAPO_RUN_DIR/workers.$NODE.tmp"
mv "$SAPO_RUN_DIR/workers.$NODE.tmp" "$SAPO_RUN_DIR/workers.$NODE"

# Fail fast: the first server to exit takes this node (and, through srun, the job) down.
STATUS=0
wait -n || STATUS=$?
for ((i = 0; i < ${#PIDS[@]}; i++)); do
  if ! kill -0 "${PIDS[$i]}" 2> /dev/null; then
    echo "[$(date +%H:%M:%S)] error: $NODE: server $i (${URLS[$i]}) exited with status $STATUS; last lines of $SAPO_RUN_DIR/$NODE-server$i.log:" >&2
    tail -n 20 "$SAPO_RUN_DIR/$NODE-server$i.log" >&2 || true
  fi
done
stop_servers
exit 1
