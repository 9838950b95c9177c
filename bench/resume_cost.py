"""Cost of resuming: the re-run after a kill at 50% of a job, as a fraction of a full run.

One clip is upscaled three times by the same command (tiny models, CPU): once whole; once
SIGKILLed right after the journal records half of its segments; once more, which resumes.
Each run is a whole command (process start and model loading included, which raises the
ratio), timed in this one invocation, so the ratio compares runs on the same machine at the
same moment. Goal: resumed / full <= 0.6.

    python bench/resume_cost.py [--frames 80] [--resolution 128] [--segment-frames 16]
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


def run(src: Path, dst: Path, models: Path, resolution: int, env: dict) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "seedvr2", "upscale", str(src), "-o", str(dst), "--quiet",
           "--dit", str(models / "dit3b_tiny.safetensors"), "--vae", str(models / "vae_tiny.safetensors"),
           "--text-embeddings", str(models / "text_64.safetensors"), "--model-dir", str(models),
           "--resolution", str(resolution), "--batch-size", "5", "--dtype", "fp32",
           "--device", "cpu"]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, **env), capture_output=True,
                            text=True)
    return time.perf_counter() - start, result.returncode


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=80)  # four segments: killed at 2 = 50%
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--segment-frames", type=int, default=16)
    parser.add_argument("--conformance", type=Path, default=Path(
        os.environ.get("SEEDVR2_CONFORMANCE", REPO.parent / "shared" / "conformance")))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny_models(args.conformance, tmp)
        src = tmp / "clip.mp4"
        make_clip(src, args.frames, width=128, height=96)
        env = {"SEEDVR2_SEGMENT_FRAMES": str(args.segment_frames), "OMP_NUM_THREADS": "1"}
        # Batches of 5 frames, no overlap: segments of segment_frames rounded up to batches.
        per_segment = -(-args.segment_frames // 5) * 5
        segments = -(-args.frames // per_segment)
        half = segments // 2
        full, code = run(src, tmp / "full.mp4", tmp, args.resolution, env)
        assert code == 0, "the full run failed"
        killed, code = run(src, tmp / "resumed.mp4", tmp, args.resolution,
                           {**env, "SEEDVR2_KILL_AT": f"journal:{half}"})
        assert code < 0, "the run to be killed was not killed"
        resumed, code = run(src, tmp / "resumed.mp4", tmp, args.resolution, env)
        assert code == 0, "the resumed run failed"
        same = (tmp / "full.mp4").read_bytes() == (tmp / "resumed.mp4").read_bytes()
    print(f"{args.frames} frames, {segments} segments, killed after {half}: full {full:.1f}s, "
          f"killed run {killed:.1f}s, re-run {resumed:.1f}s -> re-run / full = "
          f"{resumed / full:.2f} (goal <= 0.60); output identical: {same}")


if __name__ == "__main__":
    main()
