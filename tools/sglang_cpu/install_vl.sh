#!/usr/bin/env bash
# The SGLang tier's virtualenv for Qwen3-VL models: what install.sh installs, with torch 2.14.1 and a real
# torchvision 0.29.1 instead of the CPU torch 2.13.0 (SGLang's Qwen-VL processor imports torchvision.transforms;
# PyPI's torchvision runs only beside the torch it was built for). A separate venv, so the text tier keeps its
# own:   tools/sglang_cpu/install_vl.sh [VENV]   (default $SAPO_SGLANG_VL_VENV, else /opt/sapo-sglang-vl-venv)
# pip on Python 3.11 takes both wheels from this machine's disk (docs/cluster.md); about 6 GB, a few minutes.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-${SAPO_SGLANG_VL_VENV:-/opt/sapo-sglang-vl-venv}}"
python="${PYTHON:-python3}"
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
stamp="$venv/.sapo-sglang-installed"
want="sglang==$SGLANG_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION lock=$(sha256sum "$here/requirements.lock" | cut -c1-16)"
# Kept only when the stamp matches and the three pinned packages import at their versions (the CUDA wheels torch
# 2.14.1 brings make a pip-freeze comparison with the lock, as install.sh does, list dozens of extra packages).
check="import torch, torchvision, importlib.metadata as m; assert torch.__version__.startswith('$TORCH_VERSION'); \
assert torchvision.__version__.startswith('$TORCHVISION_VERSION'); assert m.version('sglang') == '$SGLANG_VERSION'"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c "$check" 2> /dev/null; then
    echo "install_vl.sh: $venv has $want"
    exit 0
fi
start=$(date +%s)
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${pip[@]}" --no-deps -r "$here/requirements.lock"
"$venv/bin/python" -c "$check"
echo "$want" > "$stamp"
echo "install_vl.sh: $venv ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
