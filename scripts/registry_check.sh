#!/usr/bin/env bash
# The Comfy Registry's pre-publish check, `comfy node validate` (issue 41): the project's
# pyproject fields, then ruff's exec/eval/one-line-statements rules over every file that is
# not git-ignored. It must pass with no warning at all, so any warning fails here.
# comfy-cli lives in its own venv (.venv-comfycli, git-ignored), never in the test .venv; it is
# installed on first use (from the package index) and the check itself runs offline: no
# telemetry, no update check, no prompt.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PIN="comfy-cli==1.23.0"
VENV="${SEEDVR2_COMFYCLI_VENV:-$ROOT/.venv-comfycli}"
stamp="$VENV/.seedvr2-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$PIN" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$PIN"
  echo "$PIN" > "$stamp"
fi
export DO_NOT_TRACK=1 COMFY_NO_UPDATE_CHECK=1
status=0
out="$("$VENV/bin/comfy" node validate < /dev/null 2>&1)" || status=$?
echo "$out"
if [ "$status" -ne 0 ] || grep -qi "warning" <<< "$out" \
    || ! grep -q "All validation checks passed successfully" <<< "$out"; then
  echo "registry check failed: comfy node validate must pass without warnings" >&2
  exit 1
fi
