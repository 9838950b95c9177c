#!/usr/bin/env bash
# What the first GPU run must measure, as one command from a checkout (about 8 minutes on one
# H200; random weights of the real shapes; nothing downloaded or installed, no network).
# Prints one table on stdout, progress on stderr, and rewrites $OUT/gpu_checks.md after every
# row when OUT is set. See bench/gpu_checks.py and docs/development.md "GPU checks".
#
#   bench/gpu_checks.sh [--rehearse] [--minutes 8] [--sections env,e2e,trace,mfu,blockswap,vae,dequant,room,lowp,vae_paths]
#   bench/gpu_checks.sh --rehearse --sections lowp --capability 7.5,8.0,8.9,10.0,12.0
#     (the lowp section on the CPU through the paths a GPU of each capability takes, every kernel
#     call checked against its preconditions: one line per format and capability, "failed 0")
#   bench/gpu_checks.sh --rehearse --fake-cuda [--capability 9.0,10.0] [--sections lowp]
#     (the GPU run's own branch at real sizes on a fake cuda:0 of each capability: fake tensors,
#     rows "(fake cuda)", times "n/a (fake)", a row "checks" per section; exit 1 on a failure)
#   bench/gpu_checks.sh --sections vae_paths    (about 4 minutes; --rehearse --capability 12.0 on
#     the CPU: one line "vae_paths PATH: time T s, peak P GiB, PSNR D dB vs today" per VAE path)
#
# The lowp section needs comfy-kitchen (0.2.40; its CUDA kernels need a torch built for CUDA 13,
# as the GPU machine's cu130 torch is). Its cp312 wheel is 68 MB, over the 64 MiB a device call
# carries; without the ROCm kernels (loaded only under a ROCm torch) it is 37 MB. In the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl comfy-kitchen==0.2.40
#   zip -d .whl/comfy_kitchen-*.whl comfy_kitchen/backends/hip/_C.abi3.so
# and on the GPU machine (carry .whl) before this script:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
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
