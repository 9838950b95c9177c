"""Frame-parallel efficiency T1 / (N * TN) with the tiny models on the CPU (gloo).

Each rank gets one thread (the machine should have at least N free cores); the same clip is
upscaled by 1 and by N processes through `seedvr2 upscale --devices cpu,...`, timing whole
commands (process start and model loading included, which only lowers the ratio).
The clip is upscaled 4x (96x64 -> 384x256) as real use does: at 1x the tiny models cost
less than decoding the input (which every rank does for its share) and encoding the output
(rank 0), so the ratio would measure video I/O rather than frame parallelism.
Goal >= 0.9.

    python bench/distributed_efficiency.py [--ranks 2] [--frames 60] [--resolution 256]
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


def run(src: Path, dst: str, models: Path, devices: str, resolution: int) -> float:
    cmd = [sys.executable, "-m", "seedvr2", "upscale", str(src), "-o", dst, "--quiet",
           "--dit", str(models / "dit3b_tiny.safetensors"), "--vae", str(models / "vae_tiny.safetensors"),
           "--text-embeddings", str(models / "text_64.safetensors"), "--model-dir", str(models),
           "--resolution", str(resolution), "--batch-size", "5", "--dtype", "fp32", "--devices", devices]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--resolution", type=int, default=256, help="output short edge")
    parser.add_argument("--conformance", type=Path, default=REPO / "tests" / "conformance")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny_models(args.conformance, tmp)
        make_clip(tmp / "in.mp4", args.frames, width=96, height=64)
        t1 = run(tmp / "in.mp4", f"{tmp}/one/", tmp, "cpu", args.resolution)
        tn = run(tmp / "in.mp4", f"{tmp}/many/", tmp, ",".join(["cpu"] * args.ranks), args.resolution)
    print(f"{args.frames} frames 96x64, output short edge {args.resolution} (tiny models), 1 thread per rank")
    print(f"1 rank: {t1:.1f} s; {args.ranks} ranks: {tn:.1f} s")
    print(f"efficiency T1/(N*TN): {t1 / (args.ranks * tn):.3f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
