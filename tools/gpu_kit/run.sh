#!/usr/bin/env bash
# The one command on the offline GPU machine (docs/gpu.md), from the repository root, the kit in .gpu_kit (carried):
#   OUT=/some/folder bash tools/gpu_kit/run.sh [gpu_check arguments]
# Installs the kit with --no-index --no-deps into a fresh folder, puts it and the project on PYTHONPATH, and runs
# tools/gpu_check.py under a 9-minute timeout; $OUT gets gpu_check.log (everything printed), gpu_check_table.md,
# gpu_check.json and environment.txt. The exit status is gpu_check's (1: a row FAILed; 3: an import is missing;
# 124: the timeout). The CPU proof (tests/test_gpu_check_kit.py) runs it with PYTHON, GPU_KIT_DIR and --allow-cpu.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${OUT:?set OUT to the folder for the table and the log}"
PYTHON="${PYTHON:-python3}"
KIT="${GPU_KIT_DIR:-.gpu_kit}"
TIMEOUT_S="${GPU_CHECK_TIMEOUT_S:-540}"
mkdir -p "$OUT"
{
    date -u
    "$PYTHON" -VV
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
    cat "$KIT/manifest.txt" 2>&1
} > "$OUT/environment.txt"
ls "$KIT"/*.whl > /dev/null || { echo "gpu_kit/run.sh: no wheels in $KIT: run tools/gpu_kit.sh and carry $KIT" | tee "$OUT/gpu_check.log"; exit 3; }
SITE="$(mktemp -d)"
"$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$KIT"/*.whl 2>&1 | tee "$OUT/pip_install.log"
[[ "${PIPESTATUS[0]}" -eq 0 ]] || { echo "gpu_kit/run.sh: the kit did not install (pip_install.log)"; exit 3; }
"$PYTHON" -m pip list >> "$OUT/environment.txt" 2>&1
PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "$TIMEOUT_S" \
    "$PYTHON" tools/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
