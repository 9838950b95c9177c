"""What a video container declares and what decoding finds (issue 44, 2.9): a stored frame
count decoding falls short of is said, naming the file and both counts; of several video
streams, the one read is named, and why."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from seedvr2.io import open_media


def _write(path, sizes, frames=12, faststart=False):
    import av

    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as out:
        streams = []
        for width, height in sizes:
            stream = out.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            streams.append(stream)
        for i in range(frames):
            for stream in streams:
                pixels = np.random.default_rng(i).integers(0, 255, (stream.height, stream.width,
                                                                     3), dtype=np.uint8)
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                frame.pts = i
                out.mux(stream.encode(frame))
        for stream in streams:
            out.mux(stream.encode(None))


def test_a_truncated_faststart_file_read_short_says_so(tmp_path):
    """The header (at the front) declares 12 frames; the data ends after some: it was
    upscaled short without a word."""
    path = tmp_path / "cut.mp4"
    _write(path, [(64, 48)], faststart=True)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])
    with open_media(path) as media:
        declared = media.info.frame_count
        with pytest.warns(UserWarning) as said:
            decoded = sum(1 for _ in media.frames())
    assert decoded < declared == 12
    assert [str(w.message) for w in said] == [
        f"{path}: the container declares 12 frames, decoding gave {decoded}: the file is "
        f"truncated or damaged, and only those are read"]


def test_a_whole_file_read_says_nothing(tmp_path):
    path = tmp_path / "whole.mp4"
    _write(path, [(64, 48)], faststart=True)
    with open_media(path) as media, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sum(1 for _ in media.frames()) == 12
        assert sum(1 for _ in media.frames(stop=5)) == 5


def test_of_two_video_streams_the_one_read_is_named(tmp_path):
    path = tmp_path / "two.mp4"
    _write(path, [(64, 48), (32, 32)], frames=3)
    with pytest.warns(UserWarning) as said:
        media = open_media(path)
    with media:
        assert (media.info.width, media.info.height) == (64, 48)
    assert str(said[0].message) == (
        f"{path}: has 2 video streams; reading stream #0 (64x48), the first that is not a "
        f"cover picture; the others are left out (ffmpeg -map 0:v:N -c copy makes a file of "
        f"the one you want)")
