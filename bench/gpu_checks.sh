#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent machine (see bench/RESULTS.md):
# the NCCL world-size-1 smoke test, GPU dequantisation, BlockSwap and DiT throughput.
# Usage: bench/gpu_checks.sh [OUTPUT_FILE]   (PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-/dev/stdout}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "== NCCL world size 1 (tests)"; "$PY" -m pytest -q tests/test_distributed.py -k nccl 2>&1 | tail -3
  echo "== dequantisation on the GPU"; (cd bench && "$PY" dequant.py --device cuda --dtype bf16)
  echo "== BlockSwap"; (cd bench && "$PY" blockswap.py)
  echo "== DiT forward bf16"; (cd bench && "$PY" dit_forward.py --device cuda --dtype bf16)
} >"$OUT" 2>&1
