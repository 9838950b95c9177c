"""seedvr2.io: reading and writing videos, images and sequences as frame streams.

All media are generated here: test clips straight with PyAV (independent of our writer),
16-bit PNGs with a tiny hand-written encoder (Pillow can't write 16-bit colour), the rest
with Pillow.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import zlib
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from seedvr2.io import MediaError, MediaInfo, OutputSpec, open_media, open_writer
from seedvr2.io import reader as reader_module

from conftest import FPS, SAMPLE_RATE, H, N, W, clip_frame as _clip_frame, make_clip as _make_clip  # noqa: E402,F401

IMAGE_SPEC = OutputSpec(width=W, height=H, channels=3, bit_depth=8)  # of _clip_frame
VIDEO_SPEC = OutputSpec(width=W, height=H, channels=3, bit_depth=8, fps=25)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    _make_clip(root / "clip.mp4")
    _make_clip(root / "clip.mkv", container_format="matroska")
    return root


def _png16(path: Path, array: np.ndarray) -> None:
    """A minimal 16-bit PNG encoder: IHDR, one IDAT of unfiltered big-endian rows, IEND."""
    h, w, c = array.shape
    raw = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in array)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", w, h, 16, {1: 0, 3: 2, 4: 6}[c], 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _audio_packets(path: Path) -> list[bytes]:
    with av.open(str(path)) as c:
        return [bytes(p) for p in c.demux(c.streams.audio[0]) if p.size]


def _visible(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


# --------------------------------------------------------------------------------------------
# Reading videos


def test_video_info(media):
    with open_media(media / "clip.mp4") as src:
        info = src.info
    assert (info.kind, info.width, info.height, info.channels, info.bit_depth) == \
        ("video", W, H, 3, 8)
    assert info.frame_count == N and info.frame_count_exact
    assert info.fps == FPS and isinstance(info.fps, Fraction)
    assert info.has_audio and info.codec == "h264"


def test_mkv_frame_count_is_counted_exactly(media):
    # Matroska stores no frame count; small files get their packets counted at open.
    info = open_media(media / "clip.mkv").info
    assert (info.frame_count, info.frame_count_exact, info.fps) == (N, True, FPS)


def test_full_decode_matches_ffmpeg(media):
    with av.open(str(media / "clip.mp4")) as c:
        reference = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    frames = list(open_media(media / "clip.mp4").frames())
    assert len(frames) == N
    assert all(np.array_equal(a, b) for a, b in zip(frames, reference))
    assert frames[0].shape == (H, W, 3) and frames[0].dtype == np.uint8


@pytest.mark.parametrize("name", ["clip.mp4", "clip.mkv"])
def test_frames_from_start_are_exact(media, name, monkeypatch):
    src = open_media(media / name)
    full = list(src.frames())
    decoded = []
    original = reader_module.VideoReader._decode

    def counting(self, container):
        for frame in original(self, container):
            decoded.append(frame.pts)
            yield frame

    monkeypatch.setattr(reader_module.VideoReader, "_decode", counting)
    for start in (1, 11, 12, 13, 25, 47, 59):
        got = list(src.frames(start, start + 4))
        want = full[start:start + 4]
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), \
            f"start={start}"
    decoded.clear()
    assert len(list(src.frames(50))) == 10
    assert len(decoded) < 30, "frames(50) should seek, not decode from the beginning"
    assert list(src.frames(N)) == [] and list(src.frames(N + 5)) == []
    assert list(src.frames(3, 3)) == []
    with pytest.raises(ValueError, match="must be >= 0"):
        src.frames(-1)


@pytest.mark.parametrize("name, timing, n", [
    ("vfr.mkv", "variable", 40), ("vfr.mp4", "variable", 40),
    ("gap.mp4", "dropped frame", 40),
    # One frame missing in 1500: the average rate is within 0.1% of the nominal one, so only
    # the count-vs-duration check can tell.
    ("rare_gap.mp4", "dropped frame", 1500),
])
def test_frames_from_start_exact_without_constant_rate(tmp_path, name, timing, n):
    """Variable frame rate or a dropped frame: timestamps no longer give frame indices, so
    frames(start) must fall back to counting and still match a full decode."""
    path = tmp_path / name
    gap = n // 2
    small = np.zeros((16, 16, 3), np.uint8)
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=FPS)
        video.width, video.height, video.pix_fmt = 16, 16, "yuv420p"
        video.codec_context.gop_size = 8
        video.options = {"preset": "ultrafast"}
        if timing == "variable":  # millisecond timestamps, as screen recorders write them
            video.codec_context.time_base = Fraction(1, 1000)
        t = 0
        for i in range(n):
            small[:] = (i * 37) % 256  # frames tell apart
            frame = av.VideoFrame.from_ndarray(small, format="rgb24")
            if timing == "variable":
                frame.pts, frame.time_base = t, Fraction(1, 1000)
                t += (33, 40, 20, 50)[i % 4]
            else:  # constant rate, but one slot is empty
                frame.pts, frame.time_base = i + (i >= gap), 1 / FPS
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
    src = open_media(path)
    full = list(src.frames())
    assert len(full) == src.info.frame_count == n
    for start in (5, gap - 3, gap + 1, gap + 10, n - 1):
        got = list(src.frames(start, start + 2))
        assert all(np.array_equal(a, b) for a, b in zip(got, full[start:start + 2])), start


# --------------------------------------------------------------------------------------------
# Writing videos


@pytest.mark.parametrize("name", ["up.mp4", "up.mkv"])
def test_write_h264_copies_audio_packets(media, tmp_path, name):
    src = open_media(media / "clip.mp4")
    dst = tmp_path / name
    spec = OutputSpec(width=2 * W, height=2 * H, audio_from=src.info)
    with open_writer(dst, spec, like=src.info) as out:
        for frame in src.frames():
            out.write(frame.repeat(2, axis=0).repeat(2, axis=1))
    info = open_media(dst).info
    assert (info.width, info.height, info.frame_count, info.fps, info.codec) == \
        (2 * W, 2 * H, N, FPS, "h264")
    assert info.has_audio
    assert _audio_packets(dst) == _audio_packets(media / "clip.mp4")
    with av.open(str(dst)) as c:
        assert c.streams.video[0].codec_context.format.name == "yuv420p"
    assert _visible(tmp_path) == [name]


def test_write_h265_10bit_from_16bit(tmp_path):
    dst = tmp_path / "deep.mp4"
    ramp = np.linspace(0, 65535, W)[None, :, None] * np.ones((H, 1, 3))
    frames = [(ramp * (0.5 + 0.1 * i)).clip(0, 65535).astype(np.uint16) for i in range(5)]
    with open_writer(dst, replace(VIDEO_SPEC, bit_depth=16, codec="h265")) as out:
        out.write_many(frames)
    src = open_media(dst)
    assert (src.info.codec, src.info.bit_depth, src.info.frame_count, src.info.fps) == \
        ("hevc", 16, 5, Fraction(25))
    with av.open(str(dst)) as c:
        assert c.streams.video[0].codec_context.format.name == "yuv420p10le"
        assert c.streams.video[0].codec_tag == "hvc1"
    back = list(src.frames())
    assert back[0].dtype == np.uint16
    # More than 8 bits survive: 8-bit data expanded to 16 bits would be multiples of 257.
    assert np.mean(back[2] % 257 != 0) > 0.5
    assert np.abs(back[2].astype(int) - frames[2]).mean() < 257


def test_write_keeps_rotation_and_gray_frames(tmp_path):
    like = MediaInfo(kind="video", path="x", frame_count=2, width=W, height=H, channels=1,
                     bit_depth=8, fps=Fraction(24000, 1001), rotation=90)
    no_audio = OutputSpec(audio_from=like)
    with open_writer(tmp_path / "gray.mkv", no_audio, like=like) as out:
        out.write(np.full((H, W), 200, np.uint8))
        out.write(np.full((H, W, 1), 50, np.uint8))
    info = open_media(tmp_path / "gray.mkv").info
    assert (info.rotation, info.fps, info.frame_count, info.channels) == (90, like.fps, 2, 3)
    assert not info.has_audio


def test_writer_rejects_bad_frames(tmp_path):
    with open_writer(tmp_path / "v.mp4", VIDEO_SPEC) as out:
        with pytest.raises(MediaError, match=r"v.mp4 frame 0: expected a frame of shape "
                                             r"\(48, 64, 3\) uint8, got \(48, 64, 3\) uint16"):
            out.write(np.zeros((H, W, 3), np.uint16))
        out.write(np.zeros((H, W, 3), np.uint8))
    assert (tmp_path / "v.mp4").is_file()


@pytest.mark.parametrize("dst, kwargs, message", [
    ("odd.mp4", dict(width=63, height=48), r"odd.mp4: H264 in yuv420 needs an even width and "
                                            r"height, got 63x48"),
    ("clip.webm", dict(codec="h265"), r"WebM holds VP8/VP9/AV1 video, not H.265"),
    ("clip.avi", {}, r"can't tell what to write from the extension '.avi'"),
    ("noext", {}, r"can't tell what to write from the extension '\(none\)'"),
    ("v.mp4", dict(codec="vp8"), r"unknown video codec 'vp8'"),
    ("v.mp4", dict(fps=None), r"a video needs a frame rate and images carry none; give one, "
                              r"e.g. fps=24"),
])
def test_writer_open_errors(tmp_path, dst, kwargs, message):
    args = dict(width=W, height=H, channels=3, bit_depth=8, fps=25) | kwargs
    with pytest.raises(MediaError, match=message):
        open_writer(tmp_path / dst, OutputSpec(**args))
    assert _visible(tmp_path) == []


def test_output_spec_takes_what_it_leaves_out_from_like(tmp_path):
    """Given fields win; the rest come from ``like`` (a video's rate, times and colour too);
    a layout field neither gives is refused, naming it."""
    like = MediaInfo(kind="video", path=str(tmp_path / "in.mkv"), frame_count=3, width=W,
                     height=H, channels=4, bit_depth=16, fps=Fraction(25),
                     frame_times=(Fraction(0), Fraction(1, 25), Fraction(3, 25)), rotation=90)
    video = OutputSpec(width=2 * W, height=2 * H, bit_depth=8).resolved(tmp_path / "o.mkv", like)
    assert (video.width, video.height, video.channels, video.bit_depth, video.fps) == \
        (2 * W, 2 * H, 4, 8, 25)
    assert video.frame_times == like.frame_times and video.colour == like.colour
    assert video.display.rotation == 90
    image = OutputSpec(fps=10).resolved(tmp_path / "o.png", like)
    assert (image.fps, image.frame_times, image.colour) == (10, None, None)
    with pytest.raises(MediaError, match=r"^open_writer: give OutputSpec\(height=\.\.\.\) \(or "
                                         r"like= a MediaInfo to copy it from\)$"):
        open_writer(tmp_path / "o.png", OutputSpec(width=W, channels=3, bit_depth=8))
    assert _visible(tmp_path) == []


# --------------------------------------------------------------------------------------------
# Never lose work, never clobber


def test_partial_file_until_close(tmp_path):
    dst = tmp_path / "out.mp4"
    out = open_writer(dst, VIDEO_SPEC)
    out.write(_clip_frame(0))
    assert not dst.exists()
    partial = [n for n in _visible(tmp_path) if n.startswith(".out.partial-")]
    assert len(partial) == 1 and partial[0].endswith(".mp4")
    out.close()
    assert _visible(tmp_path) == ["out.mp4"]
    assert open_media(dst).info.frame_count == 1


def test_abort_and_exception_leave_nothing(tmp_path):
    out = open_writer(tmp_path / "a.mp4", VIDEO_SPEC)
    out.write(_clip_frame(0))
    out.abort()
    assert _visible(tmp_path) == []
    with pytest.raises(RuntimeError, match="boom"):
        with open_writer(tmp_path / "b.png", IMAGE_SPEC) as out:
            out.write(_clip_frame(1))
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        with open_writer(str(tmp_path / "seq") + "/", IMAGE_SPEC) as out:
            out.write(_clip_frame(1))
            raise RuntimeError("boom")
    assert _visible(tmp_path) == []
    with pytest.raises(MediaError, match="no frames were written"):
        with open_writer(tmp_path / "c.mp4", VIDEO_SPEC):
            pass
    assert _visible(tmp_path) == []


def test_existing_output_is_not_overwritten(tmp_path):
    dst = tmp_path / "taken.png"
    dst.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match=r"taken.png already exists; pass "
                                              r"overwrite=True to replace it"):
        open_writer(dst, IMAGE_SPEC)
    assert dst.read_bytes() == b"precious" and _visible(tmp_path) == ["taken.png"]
    with open_writer(dst, IMAGE_SPEC, overwrite=True) as out:
        out.write(_clip_frame(3))
    assert np.array_equal(next(open_media(dst).frames()), _clip_frame(3))
    folder = tmp_path / "frames"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="frames already exists and is not empty"):
        open_writer(folder, IMAGE_SPEC)


def test_output_appearing_during_write_is_kept_safe(tmp_path):
    dst = tmp_path / "race.png"
    out = open_writer(dst, IMAGE_SPEC)
    out.write(_clip_frame(0))
    dst.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError, match=r"race.png appeared while writing.*kept at"):
        out.close()
    assert dst.read_bytes() == b"someone else's"
    kept = [n for n in _visible(tmp_path) if n.startswith(".race.png.partial-")]
    assert len(kept) == 1, "the finished frame must survive"


@pytest.mark.parametrize("overwrite", [False, True])
def test_sequence_folder_appearing_during_write(tmp_path, overwrite):
    dst = tmp_path / "frames"
    out = open_writer(f"{dst}/", IMAGE_SPEC, overwrite=overwrite)
    out.write(_clip_frame(0))
    dst.mkdir()
    (dst / "notes.txt").write_text("someone else's")
    if overwrite:  # merged in: the frame replaces nothing of theirs
        out.close()
        assert sorted(p.name for p in dst.iterdir()) == ["00000.png", "notes.txt"]
        return
    with pytest.raises(FileExistsError) as caught:
        out.close()
    kept = [n for n in _visible(tmp_path) if n.startswith(".frames.partial-")]
    assert len(kept) == 1, "the finished frames must survive"
    assert str(caught.value) == (f"{dst} appeared while writing; the finished frames are kept "
                                 f"in {tmp_path / kept[0]}")
    assert (dst / "notes.txt").read_text() == "someone else's"


@pytest.mark.parametrize("name", ["clip.mp4", "frame.png"])
def test_an_output_folder_deleted_while_writing_is_reported_as_gone(tmp_path, name):
    """Nothing survives a deleted folder, and the error says so (not "kept at gone/...")."""
    import shutil

    folder = tmp_path / "gone"
    folder.mkdir()
    out = open_writer(folder / name, replace(IMAGE_SPEC, fps=FPS))
    out.write(_clip_frame(0))
    shutil.rmtree(folder)
    with pytest.raises(MediaError) as caught:
        out.close()
    assert str(caught.value).startswith(f"{folder / name}: could not move the finished output "
                                        f"into place (")
    assert str(caught.value).endswith(f"); nothing is kept: the folder {folder} was removed "
                                      f"while writing")
    assert not folder.exists()


def test_unwritable_or_missing_folder(tmp_path, monkeypatch):
    with pytest.raises(MediaError, match=r"output folder .*nowhere does not exist"):
        open_writer(tmp_path / "nowhere" / "x.mp4", VIDEO_SPEC)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root ignores permissions: refuse the create instead
        def denying(real):
            def call(path, *args, **kwargs):
                if str(path).startswith(str(locked)):
                    raise PermissionError(13, "Permission denied", str(path))
                return real(path, *args, **kwargs)
            return call

        monkeypatch.setattr(os, "open", denying(os.open))
        monkeypatch.setattr(os, "mkdir", denying(os.mkdir))
    try:
        for name in ("x.mp4", "x.png"):
            with pytest.raises(MediaError, match=rf"cannot write to output folder {locked}: "
                                                 rf"Permission denied"):
                open_writer(locked / name, VIDEO_SPEC)
    finally:
        monkeypatch.undo()
        locked.chmod(0o755)
    assert _visible(locked) == []


# --------------------------------------------------------------------------------------------
# Images


def test_16bit_png_read_exact_and_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    for channels in (1, 3, 4):
        array = rng.integers(0, 65536, (H, W, channels), dtype=np.uint16)
        _png16(tmp_path / f"in{channels}.png", array)
        src = open_media(tmp_path / f"in{channels}.png")
        assert (src.info.kind, src.info.channels, src.info.bit_depth) == ("image", channels, 16)
        frame = next(src.frames())
        assert frame.dtype == np.uint16 and np.array_equal(frame, array)
        dst = tmp_path / f"out{channels}.png"
        with open_writer(dst, like=src.info) as out:
            out.write(frame)
        assert dst.read_bytes()[24] == 16  # IHDR bit depth
        assert np.array_equal(next(open_media(dst).frames()), array)
    # Pillow's own 16-bit gray PNG reads the same way.
    gray = rng.integers(0, 65536, (H, W), dtype=np.uint16)
    Image.fromarray(gray).save(tmp_path / "pil16.png")
    assert np.array_equal(next(open_media(tmp_path / "pil16.png").frames())[..., 0], gray)


def test_16bit_tiff_round_trip(tmp_path):
    array = np.random.default_rng(1).integers(0, 65536, (H, W, 3), dtype=np.uint16)
    with open_writer(tmp_path / "x.tiff", replace(IMAGE_SPEC, bit_depth=16)) as out:
        out.write(array)
    src = open_media(tmp_path / "x.tiff")
    assert (src.info.bit_depth, src.info.channels) == (16, 3)
    assert np.array_equal(next(src.frames()), array)


def test_rgba_gray_palette_and_la_pngs(tmp_path):
    rng = np.random.default_rng(2)
    rgba = rng.integers(0, 256, (H, W, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    src = open_media(tmp_path / "rgba.png")
    assert src.info.channels == 4
    with open_writer(tmp_path / "out.png", like=src.info) as out:
        out.write(next(src.frames()))
    with Image.open(tmp_path / "out.png") as written:
        assert written.mode == "RGBA"
    assert np.array_equal(next(open_media(tmp_path / "out.png").frames()), rgba)

    gray = rng.integers(0, 256, (H, W), dtype=np.uint8)
    Image.fromarray(gray, "L").save(tmp_path / "gray.png")
    frame = next(open_media(tmp_path / "gray.png").frames())
    assert frame.shape == (H, W, 1) and np.array_equal(frame[..., 0], gray)

    # Gray + alpha has 2 channels; it is widened to RGBA (lossless) rather than rejected.
    Image.fromarray(np.stack([gray, 255 - gray], -1), "LA").save(tmp_path / "la.png")
    src = open_media(tmp_path / "la.png")
    frame = next(src.frames())
    assert src.info.channels == 4 and frame.shape == (H, W, 4)
    assert np.array_equal(frame[..., 1], gray) and np.array_equal(frame[..., 3], 255 - gray)

    Image.fromarray(rgba[..., :3]).convert("P").save(tmp_path / "pal.png")
    assert open_media(tmp_path / "pal.png").info.channels == 3


def test_jpeg_webp_and_content_sniffing(tmp_path):
    frame = _clip_frame(5)
    for name in ("a.jpg", "a.webp"):
        with open_writer(tmp_path / name, IMAGE_SPEC) as out:
            out.write(frame)
        back = next(open_media(tmp_path / name).frames())
        assert back.shape == frame.shape and np.abs(back.astype(int) - frame).mean() < 4
    # A PNG with a misleading name is still read as a PNG.
    Image.fromarray(frame).save(tmp_path / "really_png.mp4", format="PNG")
    assert open_media(tmp_path / "really_png.mp4").info.kind == "image"
    with pytest.warns(UserWarning, match="JPEG has no alpha channel"):
        open_writer(tmp_path / "b.jpg", replace(IMAGE_SPEC, channels=4)).abort()


def test_jpeg_exif_orientation_is_applied(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown rotated 90 degrees clockwise
    Image.fromarray(_clip_frame(0)).save(tmp_path / "phone.jpg", exif=exif)
    src = open_media(tmp_path / "phone.jpg")
    assert (src.info.width, src.info.height) == (H, W)
    assert next(src.frames()).shape == (W, H, 3)


def test_float_frame_rates_snap_to_broadcast_rates():
    from seedvr2.io._common import as_fraction

    assert as_fraction(29.97) == Fraction(30000, 1001)
    assert as_fraction(23.976) == Fraction(24000, 1001)
    assert as_fraction(25.0) == 25 and as_fraction("60000/1001") == Fraction(60000, 1001)
    with pytest.raises(MediaError, match="frame rate must be positive"):
        as_fraction(0)


def test_image_destination_with_several_frames_becomes_numbered(tmp_path):
    with open_writer(tmp_path / "shot.png", IMAGE_SPEC) as out:
        for i in range(3):
            out.write(_clip_frame(i))
    assert _visible(tmp_path) == ["shot_00000.png", "shot_00001.png", "shot_00002.png"]


# --------------------------------------------------------------------------------------------
# Sequences


def test_sequence_numeric_order_patterns_and_start(tmp_path):
    folder = tmp_path / "unpadded"
    folder.mkdir()
    for i in range(12):  # 1.png .. 12.png: text order would put 10 before 2
        Image.fromarray(_clip_frame(i)).save(folder / f"{i + 1}.png")
    (folder / "readme.txt").write_text("ignored")
    src = open_media(folder)
    assert (src.info.kind, src.info.frame_count, src.info.fps) == ("sequence", 12, None)
    frames = list(src.frames())
    assert all(np.array_equal(f, _clip_frame(i)) for i, f in enumerate(frames))
    assert np.array_equal(next(src.frames(start=9)), _clip_frame(9))
    assert open_media(folder / "%d.png").info.frame_count == 12
    assert open_media(folder / "*.png").info.frame_count == 12

    padded = tmp_path / "padded"
    padded.mkdir()
    for i in range(3):
        Image.fromarray(_clip_frame(i)).save(padded / f"f_{i:05d}.png")
    Image.fromarray(_clip_frame(9)).save(padded / "f_9.png")  # not %05d: excluded
    assert open_media(padded / "f_%05d.png").info.frame_count == 3


def test_sequence_write_folder_and_read_back(tmp_path):
    like = MediaInfo(kind="sequence", path="x", frame_count=3, width=W, height=H, channels=3,
                     bit_depth=8)
    with open_writer(str(tmp_path / "out") + "/", like=like) as out:
        for i in range(3):
            out.write(_clip_frame(i))
            assert not (tmp_path / "out").exists()
    assert _visible(tmp_path / "out") == ["00000.png", "00001.png", "00002.png"]
    assert _visible(tmp_path) == ["out"]
    back = list(open_media(tmp_path / "out").frames())
    assert all(np.array_equal(b, _clip_frame(i)) for i, b in enumerate(back))
    # overwrite=True replaces the frames, removes stale ones, keeps unrelated files.
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with open_writer(tmp_path / "out", like=like, overwrite=True) as out:
        out.write(_clip_frame(7))
    assert _visible(tmp_path / "out") == ["00000.png", "notes.txt"]


# --------------------------------------------------------------------------------------------
# Bad input


def _bad_inputs(root: Path) -> list[tuple[Path, str]]:
    cases = []
    cases.append((root / "missing.mp4", r"missing.mp4: no such file or directory"))
    (root / "empty.mp4").write_bytes(b"")
    cases.append((root / "empty.mp4", r"empty.mp4: file is empty"))
    (root / "garbage.mp4").write_bytes(np.random.default_rng(0).bytes(4096))
    cases.append((root / "garbage.mp4", r"garbage.mp4: not a video or image that FFmpeg or "
                                        r"Pillow can read"))
    Image.fromarray(_clip_frame(0)).save(root / "whole.png")
    data = (root / "whole.png").read_bytes()
    (root / "truncated.png").write_bytes(data[:len(data) // 2])
    cases.append((root / "truncated.png", r"truncated.png: cannot decode image"))
    with av.open(str(root / "audio.m4a"), "w") as out:
        stream = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        chunk = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="flt",
                                           layout="mono")
        chunk.sample_rate = SAMPLE_RATE
        out.mux(stream.encode(chunk))
        out.mux(stream.encode(None))
    cases.append((root / "audio.m4a", r"audio.m4a: has no video stream \(audio only\)"))
    with av.open(str(root / "noframes.mkv"), "w") as out:  # a video track with no frames
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        out.mux(audio.encode(chunk))
        out.mux(audio.encode(None))
    cases.append((root / "noframes.mkv", r"noframes.mkv: video stream has zero frames"))
    (root / "nothing").mkdir()
    cases.append((root / "nothing", r"nothing: no images found in this folder"))
    mixed = root / "mixed"
    mixed.mkdir()
    for i in range(2):
        Image.fromarray(_clip_frame(i)).save(mixed / f"a_{i}.png")
        Image.fromarray(_clip_frame(i)).save(mixed / f"b_{i}.png")
    cases.append((mixed, r"mixed: images follow several naming patterns \(a_#.png, b_#.png\)"))
    sizes = root / "sizes"
    sizes.mkdir()
    Image.fromarray(_clip_frame(0)).save(sizes / "000.png")
    Image.fromarray(_clip_frame(1)).save(sizes / "001.png")
    Image.fromarray(_clip_frame(2)[:, :32]).save(sizes / "002.png")
    Image.fromarray(_clip_frame(3)[:, :32]).save(sizes / "003.png")
    cases.append((sizes, r"002.png: 32x48 RGB 8-bit differs from the first frame 000.png "
                         r"\(64x48 RGB 8-bit\)"))
    modes = root / "modes"
    modes.mkdir()
    Image.fromarray(_clip_frame(0)).save(modes / "0.png")
    Image.fromarray(_clip_frame(1)).convert("RGBA").save(modes / "1.png")
    cases.append((modes, r"1.png: 64x48 RGBA 8-bit differs from the first frame"))
    Image.fromarray(np.zeros((H, W), np.float32), "F").save(root / "float.tiff")
    cases.append((root / "float.tiff", r"float.tiff: unsupported image mode 'F'"))
    cases.append((root / "nope" / "%05d.png", r"folder .*nope does not exist"))
    cases.append((root / "%05d.png", r"%05d.png: no files match this pattern"))
    return cases


def test_bad_inputs_name_the_file(tmp_path):
    for path, message in _bad_inputs(tmp_path):
        with pytest.raises(MediaError, match=message):
            open_media(path)


def test_import_is_light():
    code = textwrap.dedent("""
        import sys, seedvr2.io
        print(sorted(m for m in ("av", "PIL", "torch") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]
                                                                       / "src")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
