"""Property-based hostile tests of media (issue 33): small clips made here with PyAV across
codecs, pixel formats (8/10/12-bit, 4:2:0/4:2:2/4:4:4, grey, alpha, RGB), colour descriptions
(BT.601/709/2020, PQ and HLG HDR, full and limited range, unknown or contradictory tags) and
containers, read by :func:`seedvr2.io.open_media` and upscaled by ``seedvr2 upscale``. The
invariant (tests/hostile.py): every frame read, of the clip's size, in range; or one error
naming the file; and the command line exits 0 with an output of the right frame count, or
with one clean error line. Clips are 2-3 frames of at most 24 x 16 pixels."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, reject, settings, strategies as st

from hostile import outcome, run_cli
from seedvr2.io import open_media

# (container extension, encoder, pixel formats it takes)
CODECS = [(".mp4", "libx264", ["yuv420p", "yuv422p", "yuv444p", "yuv420p10le", "gray"]),
          (".mkv", "libx265", ["yuv420p", "yuv420p10le", "yuv444p12le", "yuv422p10le"]),
          (".mkv", "ffv1", ["yuv420p", "yuva420p", "yuv444p16le", "gray16le", "bgr0", "rgb48le"]),
          (".webm", "libvpx-vp9", ["yuv420p", "yuva420p", "yuv444p"]),
          (".mov", "prores_ks", ["yuv422p10le", "yuva444p10le"]),
          (".avi", "mpeg4", ["yuv420p"]),
          (".mov", "png", ["rgb24", "rgba", "gray", "rgb48be"])]
# FFmpeg codes: matrix, primaries, transfer (2 = unspecified), range (0 unknown, 1 tv, 2 pc)
COLOURS = st.tuples(st.sampled_from([0, 1, 2, 5, 6, 9, 10]), st.sampled_from([1, 2, 5, 6, 9]),
                    st.sampled_from([1, 2, 6, 8, 13, 16, 18]), st.sampled_from([0, 1, 2]))


@st.composite
def clips(draw):
    ext, encoder, formats = draw(st.sampled_from(CODECS))
    return dict(ext=ext, encoder=encoder, pix_fmt=draw(st.sampled_from(formats)),
                width=2 * draw(st.integers(4, 12)), height=2 * draw(st.integers(4, 8)),
                frames=draw(st.integers(2, 3)), colour=draw(COLOURS),
                seed=draw(st.integers(0, 2 ** 16)))


def make(path, clip) -> None:
    """The clip, or Hypothesis's reject() where the encoder itself refuses the combination
    (libvpx takes no RGB matrix in 4:2:0): not an input anyone could give us."""
    import av

    try:
        _encode(path, clip)
    except (av.FFmpegError, ValueError):
        reject()


def _encode(path, clip) -> None:
    import av

    rng = np.random.default_rng(clip["seed"])
    with av.open(str(path), "w") as out:
        stream = out.add_stream(clip["encoder"], rate=Fraction(25))
        stream.width, stream.height, stream.pix_fmt = clip["width"], clip["height"], \
            clip["pix_fmt"]
        if clip["encoder"] == "libx265":
            stream.options = {"x265-params": "log-level=error"}
        cc = stream.codec_context
        cc.colorspace, cc.color_primaries, cc.color_trc, cc.color_range = clip["colour"]
        for index in range(clip["frames"]):
            rgba = rng.integers(0, 256, (clip["height"], clip["width"], 4), np.uint8)
            frame = av.VideoFrame.from_ndarray(rgba, format="rgba").reformat(
                format=clip["pix_fmt"])
            frame.pts = index
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def _read(path):
    with open_media(path) as reader:
        return reader.info, list(reader.frames())


@given(clip=clips())
def test_clips_are_read_whole_or_refused_naming_the_file(tmp_path_factory, clip):
    path = tmp_path_factory.mktemp("media") / f"clip{clip['ext']}"
    make(path, clip)
    result = outcome(lambda: _read(path), str(path))
    if result.refused:
        return
    info, frames = result.value
    assert len(frames) == clip["frames"]
    for frame in frames:
        assert frame.shape[:2] == (clip["height"], clip["width"]), frame.shape
        assert frame.shape[2] in (1, 3, 4) and frame.dtype in (np.uint8, np.uint16)


@settings(max_examples=settings.default.max_examples // 3)  # each runs the models: 6 in ci
@given(clip=clips())
def test_clips_upscale_or_fail_in_one_line(tiny_options, tmp_path_factory, clip):
    folder = tmp_path_factory.mktemp("media")
    path = folder / f"clip{clip['ext']}"
    make(path, clip)
    out = folder / "out.mkv"
    run = run_cli(["upscale", str(path), "-o", str(out), "--dit", tiny_options["dit"],
                   "--vae", tiny_options["vae"], "--model-dir", str(tiny_options["model_dir"]),
                   "--device", "cpu", "--dtype", "fp32", "--resolution", "16",
                   "--batch-size", "1", "--quiet"])
    if run.status != 0:  # names the input, or the output it cannot be written as
        assert run.stderr.count("error:") == 1, run.stderr
        assert str(path) in run.stderr or str(out) in run.stderr, run.stderr
        assert not out.exists()
        return
    with open_media(out) as reader:
        assert sum(1 for _ in reader.frames()) == clip["frames"]


# Sequence patterns: a folder of numbered images (and names that only look numbered), read
# through printf-style patterns and globs as users type them.

PATTERN_TOKENS = st.lists(st.sampled_from(
    ["f", "%d", "%05d", "%5d", "%0", "%", "%%", "d", "*", "?", "[0-9]", "9", "99999999999",
     "²", "٣", "-", "+", " ", "$", ".png"]), min_size=1, max_size=6).map("".join)


@pytest.fixture(scope="module")
def numbered_folder(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("numbered")
    for name in ["f00001.png", "f00002.png", "f3.png", "f².png", "f٣.png", "f-1.png", "1.png",
                 "%d.png", "f%05d.png"]:
        Image.new("RGB", (16, 12), (len(name) * 9 % 256, 0, 0)).save(folder / name, "PNG")
    return folder


@given(name=PATTERN_TOKENS)
def test_sequence_patterns_are_read_or_refused_in_one_line(numbered_folder, name):
    run = run_cli(["upscale", str(numbered_folder / name), "--dry-plan", "--batch-size", "5"])
    if run.status != 0:
        assert run.stderr.count("error:") == 1 and name in run.stderr, run.stderr


def test_a_pattern_padding_past_20_digits_is_refused(numbered_folder):
    """%99999999999d made Python build a 10^11-character number: MemoryError."""
    run = run_cli(["upscale", str(numbered_folder / "f%99999999999d.png"), "--dry-plan"])
    assert run.status == 1 and run.stderr == (
        f"error: {numbered_folder / 'f%99999999999d.png'}: %99999999999d pads frame numbers to "
        f"99999999999 digits; at most 20 are meaningful (%05d pads to 5)\n")
    run = run_cli(["upscale", str(numbered_folder / "f%d.png"), "--dry-plan", "--batch-size",
                   "5"])  # f3.png only: f00001.png, f².png, f٣.png are not as %d writes
    assert run.status == 0 and ": 1 frames, " in run.stdout, run.stdout


def test_a_glob_pathlib_refuses_is_refused_naming_it(numbered_folder):
    """Found by the long profile: pathlib's ValueError came out without the pattern."""
    run = run_cli(["upscale", str(numbered_folder / "f**"), "--dry-plan"])
    assert run.status == 1 and run.stderr == (
        f"error: {numbered_folder / 'f**'}: not a usable file name pattern (Invalid pattern: "
        f"'**' can only be an entire path component)\n")
