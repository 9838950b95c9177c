"""The determinism test's sources (tests/test_determinism.py): testsrc2 frames (an FFmpeg
filter: the same bits in every process) and an H.264 + AAC clip of them. The test encodes its
input clips once with :func:`clip`; its worker processes import :func:`testsrc2` from here."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np


def testsrc2(frames, width, height):
    graph = av.filter.Graph()
    source = graph.add("testsrc2", f"size={width}x{height}:rate=25")
    sink = graph.add("buffersink")
    source.link_to(sink)
    graph.configure()
    return [graph.pull().to_ndarray(format="rgb24") for _ in range(frames)]


def clip(path, frames):
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=25)
        video.width, video.height = frames[0].shape[1], frames[0].shape[0]
        video.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=44100, layout="mono")
        for i, array in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, 25)
            container.mux(video.encode(frame))
        total = len(frames) * 44100 // 25
        t = np.arange(total) / 44100
        samples = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        for start in range(0, total, 1024):
            chunk = av.AudioFrame.from_ndarray(samples[None, start:start + 1024],
                                               format="flt", layout="mono")
            chunk.sample_rate, chunk.pts = 44100, start
            chunk.time_base = Fraction(1, 44100)
            container.mux(audio.encode(chunk))
        container.mux(video.encode(None))
        container.mux(audio.encode(None))
