"""Cost of scene-cut detection (``scene_cuts=auto``) next to decoding, per 1080p frame, CPU.

A 1080p H.264 clip of moving random-noise shots with hard cuts is written once; then, in this
one run, the project's reader decodes it (decode only), and decodes it again feeding every
frame to the detector (decode + detect), the pass a file job makes before its plan; each best
of 3 passes. The ratio detect / decode says what the extra pass adds beyond its decode,
measured on the same machine at the same moment.

    python bench/scene_cuts.py [--frames 48] [--shot 12]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from seedvr2.io import open_media  # noqa: E402
from seedvr2.pipeline.cuts import detect_cuts, frame_features  # noqa: E402


def make_clip(path: Path, frames: int, shot: int):
    """Noise textures panning 8 px a frame; a new texture and tint every ``shot`` frames."""
    import av

    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 1920, 1080, "yuv420p"
        for i in range(frames):
            if i % shot == 0:
                texture = rng.integers(0, 256, (1080, 2400, 3), dtype=np.uint8) // 2
                texture += rng.integers(0, 128, 3, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(
                np.ascontiguousarray(texture[:, 8 * (i % shot):][:, :1920]), format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
        out.mux(video.encode(None))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--shot", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        clip = Path(folder) / "clip.mp4"
        make_clip(clip, args.frames, args.shot)
        with open_media(clip) as reader:
            found = []
            decode = min(timed(lambda: sum(1 for _ in reader.frames())) for _ in range(3))
            both = min(timed(lambda: found.append(detect_cuts(reader.frames())))
                       for _ in range(3))
            frames = list(reader.frames(stop=8))
    detect_only = min(timed(lambda: [frame_features(f) for f in frames]) for _ in range(3)) / 8
    n = args.frames
    print(f"1080p H.264, {n} frames, cuts every {args.shot}: found {list(found[0])}")
    print(f"decode:          {1000 * decode / n:7.1f} ms/frame (best of 3 passes)")
    print(f"decode + detect: {1000 * both / n:7.1f} ms/frame (best of 3 passes)")
    print(f"detect alone:    {1000 * detect_only:7.1f} ms/frame (8 decoded frames, best of 3)")
    print(f"ratio detect/decode: {detect_only / (decode / n):.3f}")


if __name__ == "__main__":
    main()
