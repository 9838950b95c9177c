"""Peak memory of a streamed upscale does not grow with video length.

Upscales a generated 640x360 clip of 30 and of 300 frames to 720p with the tiny conformance
models (CPU, fp32), each in a fresh process, and prints both peak RSS values and their ratio
(goal <= 1.1; holding 300 output frames as float32 would alone take ~3.3 GB).

    python bench/stream_memory.py [--frames 30 300] [--resolution 720]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def make_clip(path: Path, frames: int, width: int = 640, height: int = 360):
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=Fraction(25))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
        y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
        for i in range(frames):
            frame = np.concatenate([(x + 3 * i) % 256 + 0 * y, y + 0 * x, (x + y) / 2], -1)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame.astype(np.uint8), format="rgb24")))
        out.mux(stream.encode(None))


def tiny_models(conformance: Path, folder: Path):
    from safetensors.torch import load_file, save_file

    for name in ("dit3b_tiny", "vae_tiny"):
        config = json.loads((conformance / name / "config.json").read_text())["constructor_kwargs"]
        save_file(load_file(conformance / name / "weights.safetensors"), folder / f"{name}.safetensors",
                  metadata={"config": json.dumps(config)})
    e2e = load_file(conformance / "pipeline" / "e2e_video_9f.safetensors")
    save_file({"pos": e2e["inputs.txt_pos"].contiguous()}, folder / "text_64.safetensors")


def peak_rss_of_upscale(src: Path, dst: Path, models: Path, resolution: int) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of one `seedvr2 upscale` process."""
    cmd = [sys.executable, "-m", "seedvr2", "upscale", str(src), "-o", str(dst), "--quiet",
           "--dit", str(models / "dit3b_tiny.safetensors"), "--vae", str(models / "vae_tiny.safetensors"),
           "--text-embeddings", str(models / "text_64.safetensors"), "--model-dir", str(models),
           "--resolution", str(resolution), "--batch-size", "5", "--device", "cpu", "--dtype", "fp32"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"upscale failed with status {status}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, nargs=2, default=[30, 300])
    parser.add_argument("--resolution", type=int, default=720, help="output short edge")
    parser.add_argument("--conformance", type=Path, default=REPO / "tests" / "conformance")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny_models(args.conformance, tmp)
        results = []
        for n in args.frames:
            make_clip(tmp / f"in_{n}.mp4", n)
            rss, seconds = peak_rss_of_upscale(tmp / f"in_{n}.mp4", tmp / f"out_{n}.mp4", tmp,
                                               args.resolution)
            results.append(rss)
            print(f"{n} frames 640x360 -> short edge {args.resolution}: peak RSS {rss:.0f} MiB, "
                  f"{seconds:.0f} s")
        print(f"ratio peak RSS {args.frames[1]}/{args.frames[0]} frames: {results[1] / results[0]:.3f}"
              f"  (goal <= 1.1)")


if __name__ == "__main__":
    main()
