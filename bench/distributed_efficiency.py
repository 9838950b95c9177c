"""Frame-parallel efficiency T1 / (N * TN) with the tiny models on the CPU (gloo).

Each rank gets one thread (the machine should have at least N free cores); the same clip is
upscaled by 1 and by N processes through `seedvr2 upscale --devices cpu,...`, timing whole
commands (process start and model loading included, which only lowers the ratio).
Goal >= 0.9.

    python bench/distributed_efficiency.py [--ranks 2] [--frames 80]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stream_memory import REPO, make_clip, tiny_models


def run(src: Path, dst: str, models: Path, devices: str) -> float:
    cmd = [sys.executable, "-m", "seedvr2", "upscale", str(src), "-o", dst, "--quiet",
           "--dit", str(models / "dit3b_tiny.safetensors"), "--vae", str(models / "vae_tiny.safetensors"),
           "--text-embeddings", str(models / "text_64.safetensors"), "--model-dir", str(models),
           "--resolution", "64", "--batch-size", "5", "--dtype", "fp32", "--devices", devices]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--frames", type=int, default=80)
    parser.add_argument("--conformance", type=Path, default=REPO.parent / "shared" / "conformance")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny_models(args.conformance, tmp)
        make_clip(tmp / "in.mp4", args.frames, width=96, height=64)
        t1 = run(tmp / "in.mp4", f"{tmp}/one/", tmp, "cpu")
        tn = run(tmp / "in.mp4", f"{tmp}/many/", tmp, ",".join(["cpu"] * args.ranks))
    print(f"{args.frames} frames 96x64 -> 96x64 (tiny models), 1 thread per rank")
    print(f"1 rank: {t1:.1f} s; {args.ranks} ranks: {tn:.1f} s")
    print(f"efficiency T1/(N*TN): {t1 / (args.ranks * tn):.3f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
