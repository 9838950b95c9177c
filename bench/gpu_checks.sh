#!/usr/bin/env bash
# What the first GPU run must measure, as one command from a checkout (about 7 minutes on one
# H200; random weights of the real shapes; nothing downloaded or installed, no network).
# Prints one table on stdout, progress on stderr, and rewrites $OUT/gpu_checks.md after every
# row when OUT is set. See bench/gpu_checks.py and docs/development.md "GPU checks".
#
#   bench/gpu_checks.sh [--rehearse] [--minutes 7] [--sections env,e2e,mfu,blockswap,vae,dequant]
#
# The interpreter: $PYTHON if set, else the checkout's .venv if there is one, else python3
# (the machine's own Python with its torch: this script never installs anything).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" bench/gpu_checks.py "$@"
