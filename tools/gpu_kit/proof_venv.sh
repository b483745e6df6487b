#!/usr/bin/env bash
# The CPU proof's stand-in for the GPU machine (tests/test_gpu_check_kit.py): a virtualenv of tools/gpu_kit/target.txt
# with pip's dependencies, less tools/gpu_kit/absent.txt. Kept while its stamp (its path, both lists, the Python) matches.
#   tools/gpu_kit/proof_venv.sh DIR [PYTHON]
set -euo pipefail
DIR="$1"
PYTHON="${2:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
stamp="$(realpath -m "$DIR"); $("$PYTHON" -VV | tr -d '\n'); $(grep -hv '^\s*#' "$HERE/target.txt" "$HERE/absent.txt" | sha256sum | cut -c1-16)"
if [[ -f "$DIR/.stamp" && "$(cat "$DIR/.stamp")" == "$stamp" ]]; then
    echo "proof_venv: $DIR is current"
    exit 0
fi
rm -rf "$DIR"
"$PYTHON" -m venv "$DIR"
quiet() { { grep -v -e "is ignored: it is neither a file nor a directory" -e "as it is not installed" || true; } >&2; }
"$DIR/bin/pip" install --quiet --disable-pip-version-check -r "$HERE/target.txt" 2>&1 | quiet
mapfile -t absent < <(grep -v '^\s*#' "$HERE/absent.txt" | grep .)
"$DIR/bin/pip" uninstall --quiet --yes "${absent[@]}" 2>&1 | quiet
echo "$stamp" > "$DIR/.stamp"
echo "proof_venv: built $DIR"
