"""Cost of resuming: the re-run after a kill at 50% of a job, as a fraction of a full run.

Two clips are upscaled three times each by the same command (tiny models, CPU): once whole;
once SIGKILLed right after the journal records half of its batches; once more, which
resumes. The long clip keeps closed segments (``--segment-frames``) and is killed after half
of them; the short one (``--short-frames``, one segment at the default segment length) keeps
parts of its only segment at every chunk's end (checkpoint interval 0 s, standing in for the
minute of a real job) and is killed after half of its batches. Each run is a whole command
(process start and model loading included, which raises the ratio), timed in this one
invocation, so the ratio compares runs on the same machine at the same moment. Goal:
resumed / full <= 0.6 for both.

    python bench/resume_cost.py [--frames 80] [--short-frames 40] [--resolution 128]
                                [--segment-frames 16] [--clips long,short]
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


def measure(tmp: Path, name: str, frames: int, resolution: int, env: dict, kill: str,
            batches_kept: int, batches: int):
    src = tmp / f"{name}.mp4"
    make_clip(src, frames, width=128, height=96)
    full, code = run(src, tmp / f"{name}-full.mp4", tmp, resolution, env)
    assert code == 0, f"the full run of the {name} clip failed"
    killed, code = run(src, tmp / f"{name}-resumed.mp4", tmp, resolution,
                       {**env, "SEEDVR2_KILL_AT": kill})
    assert code < 0, f"the {name} run to be killed was not killed"
    resumed, code = run(src, tmp / f"{name}-resumed.mp4", tmp, resolution, env)
    assert code == 0, f"the resumed run of the {name} clip failed"
    same = (tmp / f"{name}-full.mp4").read_bytes() == (tmp / f"{name}-resumed.mp4").read_bytes()
    print(f"{name}: {frames} frames, killed after {batches_kept} of {batches} batches were "
          f"kept: full {full:.1f}s, killed run {killed:.1f}s, re-run {resumed:.1f}s -> "
          f"re-run / full = {resumed / full:.2f} (goal <= 0.60); output identical: {same}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=80)  # four segments: killed at 2 = 50%
    parser.add_argument("--short-frames", type=int, default=40)  # eight batches, one segment
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--segment-frames", type=int, default=16)
    parser.add_argument("--clips", default="long,short", help="which clips to measure")
    parser.add_argument("--conformance", type=Path, default=Path(
        os.environ.get("SEEDVR2_CONFORMANCE", REPO.parent / "shared" / "conformance")))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny_models(args.conformance, tmp)
        env = {"SEEDVR2_SEGMENT_FRAMES": str(args.segment_frames), "OMP_NUM_THREADS": "1"}
        # Batches of 5 frames, no overlap: segments of segment_frames rounded up to batches.
        per_segment = -(-args.segment_frames // 5) * 5
        segments = -(-args.frames // per_segment)
        half = segments // 2
        clips = args.clips.split(",")
        if "long" in clips:
            measure(tmp, "long", args.frames, args.resolution, env, f"journal:{half}",
                    half * per_segment // 5, -(-args.frames // 5))
        batches = -(-args.short_frames // 5)
        if "short" in clips:
            measure(tmp, "short", args.short_frames, args.resolution,
                    {"OMP_NUM_THREADS": "1", "SEEDVR2_CHECKPOINT_SECONDS": "0"},
                    f"part:{batches // 2}", batches // 2, batches)


if __name__ == "__main__":
    main()
