#!/usr/bin/env bash
# A separate virtualenv with the real SGLang for the CPU conformance tier (tests/sglang_real), kept apart from the
# project's own .venv:   tools/sglang_cpu/install.sh [VENV]
# VENV defaults to $SAPO_SGLANG_VENV, else /opt/sapo-sglang-venv (outside the clone, so that later CI runs on the
# same machine find it). Idempotent, but it trusts no state left outside the clone: an existing VENV is kept only
# when `pip freeze` there lists exactly the lock, sglang and torch at their pins (0.5 s); anything else (a missing,
# extra or other-version package, a local direct reference, a half-finished install) rebuilds it from scratch.
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

# What `pip freeze` must print, lower-cased and sorted: the lock, SGLang, and torch (a local build such as
# 2.13.0+cpu counts as 2.13.0).
expected() {
    { grep -v '^[[:space:]]*\(#\|$\)' "$here/requirements.lock"; echo "sglang==$SGLANG_VERSION"; echo "torch==$TORCH_VERSION"; } |
        tr '[:upper:]' '[:lower:]' | sort
}
installed() {
    "$venv/bin/python" -m pip freeze --disable-pip-version-check 2> /dev/null |
        sed -e "s/^torch==$TORCH_VERSION+[[:alnum:].]*$/torch==$TORCH_VERSION/" | tr '[:upper:]' '[:lower:]' | sort
}
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
    if difference="$(diff <(expected) <(installed))"; then
        echo "install.sh: $venv has exactly $want (verified with pip freeze)"
        exit 0
    fi
    echo "install.sh: $venv differs from the lock, rebuilding it (diff: expected < > installed):" >&2
    head -n 20 <<< "$difference" >&2
fi
start=$(date +%s)
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${pip[@]}" --no-deps -r "$here/requirements.lock"
"$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
if ! difference="$(diff <(expected) <(installed))"; then
    echo "install.sh: the fresh $venv does not match the lock (expected < > installed):" >&2
    head -n 20 <<< "$difference" >&2
    exit 1
fi
echo "$want" > "$stamp"
echo "install.sh: $venv ready in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
