#!/usr/bin/env bash
# The GPU checks of issue 12 as one command from a fresh checkout (about 8 minutes on one
# H200; random weights of the real shapes, nothing downloaded). Prints one summary table on
# stdout; progress goes to stderr. See bench/gpu_checks.py and README "GPU checks".
#
#   bench/gpu_checks.sh [--dry-run] [--minutes 8] [--sections dtype,blockswap,mfu,vae,e2e]
#
# The environment comes from scripts/env.sh (the pinned .venv; nothing else is installed).
# PYTHON=/path/to/python uses that interpreter instead (and skips scripts/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  source scripts/env.sh
  PYTHON="$VENV/bin/python"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" bench/gpu_checks.py "$@"
