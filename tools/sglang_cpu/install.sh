#!/usr/bin/env bash
# A separate virtualenv with the real SGLang for the CPU conformance tier (tests/sglang_real), kept apart from the
# project's own .venv:   tools/sglang_cpu/install.sh [VENV]
# VENV defaults to $SAPO_SGLANG_VENV, else /opt/sapo-sglang-venv (outside the clone, so that later CI runs on the
# same machine find it). Idempotent: a stamp file records what was installed; a second run costs seconds.
#
# What it installs (docs/cluster.md, "Real SGLang on CPU"): the local CPU build of torch 2.13.0, SGLang 0.5.23
# without its declared dependencies (they pin a CUDA torch 2.14.1, sglang-kernel, flashinfer, ...: 11 GB), and the
# pure-Python / CPU packages it imports on its CPU path, pinned in requirements.lock (no torchvision: PyPI's is
# built against CUDA torch; the shim stands in for it). About 2.4 GB.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-${SAPO_SGLANG_VENV:-/opt/sapo-sglang-venv}}"
python="${PYTHON:-python3}"
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
stamp="$venv/.sapo-sglang-installed"
want="sglang==$SGLANG_VERSION torch==$TORCH_VERSION lock=$(sha256sum "$here/requirements.lock" | cut -c1-16)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "install.sh: $venv already has $want"
    exit 0
fi
start=$(date +%s)
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${pip[@]}" --no-deps -r "$here/requirements.lock"
"$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
echo "$want" > "$stamp"
echo "install.sh: $venv ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
