"""Every frame, rotation and pixel aspect of a source survive (issue 21, items 6-8).

Multi-frame images (animated WebP and PNG, multi-page TIFF) give all their frames with their
durations and are written back animated; a video's display matrix (rotation, mirror) and
sample aspect ratio are kept as tags in video outputs and applied to image outputs, which
have neither. Media are generated with Pillow and PyAV; upscaling uses the tiny models."""

from __future__ import annotations

import dataclasses
import warnings
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from seedvr2.cli import main
from seedvr2.io import MediaError, MediaInfo, OutputSpec, open_media, open_writer

from conftest import make_clip

DURATIONS_MS = [40, 80, 120, 40, 200]
LOOP = 3


def _cli_args(tiny_options, *extra):
    return ["upscale", "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
            "--model-dir", str(tiny_options["model_dir"]), "--device", "cpu", "--dtype", "fp32",
            "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
            "--resolution", "32", "--batch-size", "5", "--quiet", *extra]


def _rgba_frames(count: int = 5, width: int = 32, height: int = 24) -> list[np.ndarray]:
    """Frames that differ from each other, with a transparent right half."""
    frames = []
    for i in range(count):
        frame = np.zeros((height, width, 4), np.uint8)
        frame[..., 0] = 40 * i + 20
        frame[..., 1] = np.linspace(0, 255, height, dtype=np.uint8)[:, None]
        frame[..., 2] = 200 - 30 * i
        frame[:, : width // 2, 3] = 255
        frames.append(frame)
    return frames


def _save_animation(path: Path, frames: list[np.ndarray]) -> None:
    images = [Image.fromarray(f) for f in frames]
    options = {"save_all": True, "append_images": images[1:]}
    if path.suffix == ".webp":
        options.update(duration=DURATIONS_MS, loop=LOOP, lossless=True)
    elif path.suffix == ".png":
        options.update(duration=DURATIONS_MS, loop=LOOP)
    images[0].save(path, **options)


def _same_picture(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal alpha, and equal colour wherever a pixel shows (WebP does not keep the colour
    of fully transparent pixels)."""
    shown = b[..., 3] > 0
    return np.array_equal(a[..., 3], b[..., 3]) and np.array_equal(a[shown], b[shown])


def _nearest(frame: np.ndarray, candidates: list[np.ndarray]) -> int:
    errors = [np.abs(frame.astype(int) - c).mean() for c in candidates]
    return int(np.argmin(errors))


# ---------------------------------------------------------------------------------------------
# 21.6: multi-frame images


@pytest.mark.parametrize("ext", [".webp", ".png", ".tiff"])
def test_every_frame_of_an_animation_is_read_with_its_duration(tmp_path, ext):
    frames = _rgba_frames()
    path = tmp_path / f"anim{ext}"
    _save_animation(path, frames)
    with open_media(path) as reader:
        info = reader.info
        got = list(reader.frames())
        middle = list(reader.frames(start=2, stop=4))
    assert (info.kind, info.frame_count, info.channels, info.bit_depth) == \
        ("animation", 5, 4, 8)
    assert all(_same_picture(a, b) for a, b in zip(got, frames)) and len(got) == 5
    assert all(_same_picture(a, b) for a, b in zip(middle, frames[2:4])) and len(middle) == 2
    if ext == ".tiff":  # pages carry no timing: like images, they need a rate for a video
        assert (info.frame_durations, info.fps, info.loop) == (None, None, None)
    else:
        assert info.frame_durations == tuple(Fraction(ms, 1000) for ms in DURATIONS_MS)
        assert info.loop == LOOP
        assert info.fps == 25  # the most common duration, 40 ms
        assert info.frame_times == (0, Fraction(1, 25), Fraction(3, 25), Fraction(6, 25),
                                    Fraction(7, 25))


@pytest.mark.parametrize("src_ext", [".webp", ".png"])
@pytest.mark.parametrize("out_ext", [".webp", ".png", ".tiff"])
def test_an_animation_is_written_back_animated(tmp_path, src_ext, out_ext):
    frames = _rgba_frames()
    src = tmp_path / f"anim{src_ext}"
    _save_animation(src, frames)
    out = tmp_path / f"out{out_ext}"
    with open_media(src) as reader, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_writer(out, like=reader.info) as writer:
            writer.write_many(reader.frames())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, out.name])
    with open_media(out) as result:
        info = result.info
        got = list(result.frames())
    assert (info.kind, info.frame_count, info.channels) == ("animation", 5, 4)
    if out_ext == ".webp":  # lossy: each frame is still nearest to its own source frame
        assert [_nearest(g, frames) for g in got] == list(range(5))
        assert all(np.array_equal(g[..., 3], f[..., 3]) for g, f in zip(got, frames))
    else:
        assert all(_same_picture(g, f) for g, f in zip(got, frames))
    if out_ext == ".tiff":
        assert info.frame_durations is None
        assert [str(w.message) for w in caught] == [
            f"{out}: not carried over from {src}: its frame durations (TIFF pages have no "
            f"timing; write .png, .webp or a video to keep them)"]
    else:
        assert info.frame_durations == tuple(Fraction(ms, 1000) for ms in DURATIONS_MS)
        assert info.loop == LOOP and not caught


def test_an_animation_into_a_video_keeps_each_frames_time(tmp_path):
    src = tmp_path / "anim.webp"
    _save_animation(src, _rgba_frames(width=32, height=24))
    out = tmp_path / "out.mkv"
    with open_media(src) as reader, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # alpha dropped by H.264: said elsewhere
        with open_writer(out, like=reader.info) as writer:
            writer.write_many(reader.frames())
    with av.open(str(out)) as container:
        times = [frame.time for frame in container.decode(video=0)]
    assert times == pytest.approx([0, 0.04, 0.12, 0.24, 0.28], abs=1e-3)  # Matroska: 1 ms


def test_an_animation_into_jpeg_names_what_is_lost(tmp_path):
    src = tmp_path / "anim.png"
    _save_animation(src, _rgba_frames())
    with open_media(src) as reader, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with open_writer(tmp_path / "out.jpg", like=reader.info) as writer:
            writer.write_many(reader.frames())
    assert sorted(p.name for p in tmp_path.glob("out*")) == [f"out_{i:05d}.jpg"
                                                             for i in range(5)]
    assert str(caught[0].message) == (
        f"{tmp_path / 'out.jpg'}: not carried over from {src}: its animation (.jpg holds one "
        f"frame: numbered frames without their timing; write .png, .webp or a video to keep "
        f"it)")

    with open_media(src) as reader, pytest.warns(UserWarning) as caught:
        open_writer(f"{tmp_path / 'frames'}/", like=reader.info).abort()
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'frames'}: not carried over from {src}: its animation (a folder holds "
        f"numbered frames without their timing; write .png, .webp or a video to keep it)"]


def test_untimed_pages_into_a_timed_animation_need_a_rate(tmp_path):
    src = tmp_path / "pages.tiff"
    _save_animation(src, _rgba_frames())
    with open_media(src) as reader:
        with pytest.raises(MediaError) as refused:
            open_writer(tmp_path / "out.webp", like=reader.info)
        assert str(refused.value) == (
            f"{tmp_path / 'out.webp'}: an animated WEBP needs a duration for each frame and "
            f"the pages of {src} have none; give a frame rate, e.g. fps=10, or write .tiff")
        with open_writer(tmp_path / "out.webp", OutputSpec(fps=10), like=reader.info) as writer:
            writer.write_many(reader.frames())
    assert open_media(tmp_path / "out.webp").info.frame_durations == (Fraction(1, 10),) * 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.webp", "pages.tiff"]


def test_multi_frame_files_that_cannot_be_read_whole_are_refused_at_open(tmp_path):
    pages = tmp_path / "sizes.tiff"
    first, *rest = [Image.fromarray(f) for f in _rgba_frames(2)]
    first.save(pages, save_all=True, append_images=[Image.new("RGBA", (16, 16))])
    with pytest.raises(MediaError) as refused:
        open_media(pages)
    assert str(refused.value) == (f"{pages}: frame 1 of this multi-page TIFF is 16x16, frame 0 "
                                  f"is 32x24; every frame needs the same size")

    deep = tmp_path / "deep.tiff"
    gray = [Image.fromarray(np.full((8, 8), 1000 * i, np.uint16)) for i in range(3)]
    gray[0].save(deep, save_all=True, append_images=gray[1:])
    with pytest.raises(MediaError) as refused:
        open_media(deep)
    assert str(refused.value) == (
        f"{deep}: a 16-bit multi-page TIFF can't be read at full precision (its frames would "
        f"be cut to 8 bits); save the frames as 16-bit PNG files and pass the folder")

    apng = tmp_path / "deep.png"  # 16-bit RGB: found in the header chunks, before Pillow
    with av.open(str(apng), "w", format="apng") as out:
        stream = out.add_stream("apng", rate=10)
        stream.width, stream.height, stream.pix_fmt = 8, 8, "rgb48be"
        for i in range(3):
            picture = np.full((8, 8, 3), 1000 * i, np.uint16)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb48le")))
        out.mux(stream.encode(None))
    with pytest.raises(MediaError) as refused:
        open_media(apng)
    assert str(refused.value) == (
        f"{apng}: a 16-bit animated PNG can't be read at full precision (its frames would be "
        f"cut to 8 bits); save the frames as 16-bit PNG files and pass the folder")

    folder = tmp_path / "seq"
    folder.mkdir()
    Image.fromarray(_rgba_frames(1)[0]).save(folder / "00000.png")
    _save_animation(folder / "00001.png", _rgba_frames())
    with pytest.raises(MediaError) as refused:
        open_media(folder)
    assert str(refused.value) == (
        f"{folder / '00001.png'}: holds 5 frames (an animated or multi-page image); the images "
        f"of a sequence must have one frame each -- upscale this file on its own")


def test_cli_upscales_every_frame_of_an_animated_webp_into_one_webp(tiny_options, tmp_path):
    src = tmp_path / "anim.webp"
    _save_animation(src, _rgba_frames())
    assert main(_cli_args(tiny_options, str(src))) == 0
    with open_media(tmp_path / "anim_seedvr2_32p.webp") as result:
        info = result.info
    assert (info.kind, info.frame_count, info.channels, info.height) == ("animation", 5, 4, 32)
    assert info.frame_durations == tuple(Fraction(ms, 1000) for ms in DURATIONS_MS)
    assert info.loop == LOOP


# ---------------------------------------------------------------------------------------------
# 21.7: rotation


def _stored_frames(count: int = 5, width: int = 48, height: int = 32) -> list[np.ndarray]:
    """Frames with an asymmetric mark (top-left block) and a gradient, so any turn or flip
    shows."""
    frames = []
    for i in range(count):
        frame = np.zeros((height, width, 3), np.uint8)
        frame[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)
        frame[..., 1] = 20 * i
        frame[: height // 4, : width // 6, 2] = 255
        frames.append(frame)
    return frames


def _video(path: Path, frames, *, rotation: int = 0, mirrored: bool = False,
           pixel_aspect: Fraction | None = None) -> None:
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=24)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "0"}
        if rotation or mirrored:
            stream.set_display_rotation(rotation, hflip=mirrored)
        if pixel_aspect is not None:
            stream.codec_context.sample_aspect_ratio = pixel_aspect
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode(None))


@pytest.mark.parametrize("rotation, mirrored", [(-90, False), (90, False), (-180, False),
                                                (0, True), (90, True)])
def test_display_matrix_is_read_and_image_outputs_are_upright(tmp_path, rotation, mirrored):
    """FFmpeg reports a mirror as a 180-degree turn; the matrix tells them apart."""
    _video(tmp_path / "v.mp4", _stored_frames(2), rotation=rotation, mirrored=mirrored)
    with open_media(tmp_path / "v.mp4") as reader:
        info = reader.info
        stored = list(reader.frames())
    assert (info.rotation, info.mirrored) == (rotation, mirrored)

    with open_writer(f"{tmp_path / 'out'}/", like=info) as writer:
        writer.write_many(stored)
    upright = [np.rot90(f, rotation // 90) for f in stored]  # rot90: counter-clockwise
    upright = [f[:, ::-1] if mirrored else f for f in upright]
    with open_media(tmp_path / "out") as result:
        assert all(np.array_equal(a, b) for a, b in zip(result.frames(), upright))

    with open_writer(tmp_path / "out.mkv", like=info) as writer:  # video: the tag travels
        writer.write_many(stored)
    again = open_media(tmp_path / "out.mkv").info
    assert (again.rotation, again.mirrored, again.width, again.height) == \
        (rotation, mirrored, 48, 32)


def test_exif_oriented_jpeg_is_read_upright(tmp_path):
    """Already so before issue 21 (Pillow's exif_transpose); kept as a guard."""
    stored = _stored_frames(1)[0]
    image = Image.fromarray(stored)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    image.save(tmp_path / "phone.jpg", exif=exif, quality=100, subsampling=0)
    with open_media(tmp_path / "phone.jpg") as reader:
        frame = next(iter(reader.frames()))
        assert (reader.info.width, reader.info.height) == (32, 48)
    reference = np.rot90(stored, -1)
    assert _nearest(frame, [reference, np.rot90(stored, 1), stored[::-1].swapaxes(0, 1)]) == 0


def test_cli_portrait_phone_video_gives_portrait_pngs_and_keeps_the_tag(tiny_options,
                                                                        tmp_path, monkeypatch):
    """The same stored pixels with and without the tag: the tagged run's PNGs are the
    untagged run's turned upright, exactly; the video output keeps the tag. With segments
    (resume), the final writer turns the PNGs upright once."""
    frames = _stored_frames(10)
    _video(tmp_path / "phone.mp4", frames, rotation=-90)
    _video(tmp_path / "flat.mp4", frames)
    assert main(_cli_args(tiny_options, str(tmp_path / "flat.mp4"), "-o",
                          f"{tmp_path / 'flat'}/")) == 0
    monkeypatch.setenv("SEEDVR2_SEGMENT_FRAMES", "5")
    assert main(_cli_args(tiny_options, str(tmp_path / "phone.mp4"), "-o",
                          f"{tmp_path / 'phone'}/")) == 0
    with open_media(tmp_path / "phone") as phone, open_media(tmp_path / "flat") as flat:
        assert (phone.info.width, phone.info.height, phone.info.frame_count) == (32, 48, 10)
        assert all(np.array_equal(p, np.rot90(f, -1))
                   for p, f in zip(phone.frames(), flat.frames()))
    assert main(_cli_args(tiny_options, str(tmp_path / "phone.mp4"))) == 0
    video = open_media(tmp_path / "phone_seedvr2_32p.mp4").info
    assert (video.rotation, video.mirrored, video.width, video.height) == (-90, False, 48, 32)
    # A turned and mirrored source: the joined segments keep the whole matrix (a rotation
    # set on the joined stream alone would drop the mirror).
    _video(tmp_path / "selfie.mp4", frames, rotation=90, mirrored=True)
    assert main(_cli_args(tiny_options, str(tmp_path / "selfie.mp4"))) == 0
    video = open_media(tmp_path / "selfie_seedvr2_32p.mp4").info
    assert (video.rotation, video.mirrored, video.frame_count) == (90, True, 10)


# ---------------------------------------------------------------------------------------------
# 21.8: non-square pixels


def _rows_only(width: int = 48, height: int = 32) -> np.ndarray:
    """Content that changes only down the frame: widening it must leave every row as is."""
    frame = np.zeros((height, width, 3), np.uint8)
    frame[...] = np.linspace(0, 255, height, dtype=np.uint8)[:, None, None]
    return frame


@pytest.mark.parametrize("pixel_aspect, shown", [(Fraction(2), (96, 32)),
                                                 (Fraction(8, 9), (48, 36))])
def test_pixel_aspect_is_kept_in_videos_and_squared_in_images(tmp_path, pixel_aspect, shown):
    _video(tmp_path / "wide.mkv", [_rows_only()] * 2, pixel_aspect=pixel_aspect)
    with open_media(tmp_path / "wide.mkv") as reader:
        info = reader.info
        stored = list(reader.frames())
    assert info.pixel_aspect == pixel_aspect

    for ext in (".mkv", ".mp4"):
        with open_writer(tmp_path / f"out{ext}", like=info) as writer:
            writer.write_many(stored)
        again = open_media(tmp_path / f"out{ext}").info
        assert (again.pixel_aspect, again.width, again.height) == (pixel_aspect, 48, 32)

    with open_writer(tmp_path / "out.png", like=info) as writer:
        writer.write_many(stored)
    with Image.open(tmp_path / "out_00000.png") as image:
        assert image.size == shown
        result = np.array(image)
    if pixel_aspect > 1:  # only widened: each row keeps its one value
        assert np.array_equal(result, np.repeat(stored[0][:, :1], shown[0], axis=1))


def test_cli_anamorphic_video_keeps_its_shape(tiny_options, tmp_path, monkeypatch):
    """Also through resume segments, which are joined (video) or read back (images)."""
    _video(tmp_path / "wide.mkv", [_rows_only() for _ in range(10)], pixel_aspect=Fraction(2))
    monkeypatch.setenv("SEEDVR2_SEGMENT_FRAMES", "5")
    assert main(_cli_args(tiny_options, str(tmp_path / "wide.mkv"))) == 0
    video = open_media(tmp_path / "wide_seedvr2_32p.mkv").info
    assert (video.pixel_aspect, video.width, video.height, video.frame_count) == \
        (2, 48, 32, 10)
    assert main(_cli_args(tiny_options, str(tmp_path / "wide.mkv"), "-o",
                          f"{tmp_path / 'frames'}/")) == 0
    frames = open_media(tmp_path / "frames").info
    assert (frames.width, frames.height, frames.frame_count) == (96, 32, 10)


def test_image_writer_left_as_stored_when_asked(tmp_path):
    """Intermediate files (resume segments) are read back and written again: as stored."""
    like = MediaInfo(kind="video", path="x", frame_count=1, width=48, height=32, channels=3,
                     bit_depth=8, fps=Fraction(24), rotation=90, pixel_aspect=Fraction(2))
    frame = _stored_frames(1)[0]
    with open_writer(f"{tmp_path / 'raw'}/", OutputSpec(upright=False), like=like) as writer:
        writer.write(frame)
    assert np.array_equal(next(iter(open_media(tmp_path / "raw").frames())), frame)
    with open_writer(f"{tmp_path / 'shown'}/", like=dataclasses.replace(like, pixel_aspect=1)) \
            as writer:
        writer.write(frame)
    assert np.array_equal(next(iter(open_media(tmp_path / "shown").frames())),
                          np.rot90(frame, 1))


def test_a_png_folder_names_the_audio_it_leaves_out(tmp_path):
    """Folder outputs used to skip the warning single images give."""
    make_clip(tmp_path / "sound.mp4", frames=2)
    with open_media(tmp_path / "sound.mp4") as reader, pytest.warns(UserWarning) as caught:
        open_writer(f"{tmp_path / 'frames'}/", like=reader.info).abort()
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'frames'}: not carried over from {tmp_path / 'sound.mp4'}: its audio "
        f"(images hold none; write a video to keep it)"]
