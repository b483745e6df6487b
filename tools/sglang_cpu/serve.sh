#!/usr/bin/env bash
# Start the real SGLang server on a CPU-only machine, for the conformance tests (tests/sglang_real) only:
#   tools/sglang_cpu/serve.sh --model-path DIR --port P [more sglang.launch_server flags ...]
# Runs `python -m sglang.launch_server` from the virtualenv that tools/sglang_cpu/install.sh made
# ($SAPO_SGLANG_VENV, default /opt/sapo-sglang-venv) with tools/sglang_cpu/shim ahead on PYTHONPATH
# (docs/cluster.md, "Real SGLang on CPU"). Binds 127.0.0.1 only. Refuses to run where CUDA is present.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${SAPO_SGLANG_VENV:-/opt/sapo-sglang-venv}"
python="$venv/bin/python"
if [[ ! -f "$venv/.sapo-sglang-installed" ]]; then
    echo "serve.sh: no SGLang virtualenv at $venv; run tools/sglang_cpu/install.sh $venv first" >&2
    exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "serve.sh: this machine has a GPU; run SGLang itself there, not this CPU shim" >&2
    exit 2
fi
export PYTHONPATH="$here/shim${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_USE_CPU_ENGINE=1
# As launch/rollout_node.sh: SGLang keeps images' vision embeddings across weight updates unless this cache is off.
export SGLANG_VLM_CACHE_SIZE_MB="${SGLANG_VLM_CACHE_SIZE_MB:-0}"
# One thread per process: the test machines have 2 cores, shared with the trainer under test.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$python" -m sglang.launch_server --host 127.0.0.1 --device cpu --attention-backend torch_native \
    --skip-server-warmup --disable-overlap-schedule --max-total-tokens 8192 "$@"
