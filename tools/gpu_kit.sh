#!/usr/bin/env bash
# The GPU kit (docs/gpu.md): downloads the wheels of tools/gpu_kit/kit.txt (what tools/gpu_check.py imports
# beyond what the offline GPU machine has) for CPython 3.12 on manylinux x86-64 into a git-ignored folder, writes
# its manifest (commit, Python, wheels with sha256), prints its size and refuses one over 60 MiB (the device
# machine takes the working tree and carried folders up to 64 MiB in all).
#
#   tools/gpu_kit.sh                      # -> .gpu_kit/ (make gpu-kit)
#   GPU_KIT_DIR=DIR GPU_KIT_PYTHON=3.11 tools/gpu_kit.sh   # another folder / Python (the CPU proof uses 3.11)
#   (GPU_KIT_PINS: another pin list; GPU_KIT_LIMIT_MIB: another limit, for the tests)
#
# Needs pip and the package index; the wheels install there with
#   python3 -m pip install --no-index --no-deps --target DIR .gpu_kit/*.whl
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="${GPU_KIT_DIR:-$ROOT/.gpu_kit}"
PYVER="${GPU_KIT_PYTHON:-3.12}"
PYTHON="${PYTHON:-python3}"
LIMIT_MIB="${GPU_KIT_LIMIT_MIB:-60}"
PINS="${GPU_KIT_PINS:-$ROOT/tools/gpu_kit/kit.txt}"

mapfile -t wanted < <(grep -v '^\s*#' "$PINS" | sed 's/#.*//; s/\s//g' | grep .)
for pin in "${wanted[@]}"; do
    [[ "$pin" == *==* ]] || { echo "gpu_kit: $PINS: '$pin' is not pinned (name==version)" >&2; exit 2; }
done

rm -rf "$KIT"
mkdir -p "$KIT"
# --no-deps: kit.txt lists every dependency itself (the GPU machine installs with --no-deps as well)
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest "$KIT" "${wanted[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

count=$(find "$KIT" -maxdepth 1 -name '*.whl' | wc -l)
if [[ "$count" -ne "${#wanted[@]}" ]]; then
    echo "gpu_kit: ${#wanted[@]} pins but $count wheels in $KIT" >&2
    exit 1
fi
{
    echo "commit $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "python $PYVER (cp${PYVER/./}, manylinux x86-64)"
    (cd "$KIT" && sha256sum -- *.whl)
} > "$KIT/manifest.txt"

bytes=$(du -sb "$KIT" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_kit: ${#wanted[@]} wheels for Python $PYVER in $KIT: $mib MiB"
(cd "$KIT" && ls -1 -- *.whl | sed 's/^/  /')
if (( bytes > LIMIT_MIB * 1048576 )); then
    echo "gpu_kit: $mib MiB is over the $LIMIT_MIB MiB limit (the device machine carries 64 MiB in all): drop a wheel from $PINS; $KIT removed" >&2
    rm -rf "$KIT"
    exit 1
fi
