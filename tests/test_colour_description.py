"""Colour descriptions survive: a video's matrix, primaries, transfer and range go from the
source to the output, HDR (PQ, HLG) included, and the colours stay the colours.

Each source is made here with PyAV from flat RGB patches, encoded losslessly with its tags;
source and output are decoded by the same reader (:func:`seedvr2.io.open_media`).
"""

from __future__ import annotations

import av
import numpy as np
import pytest

from seedvr2.io import MediaError, OutputSpec, open_media, open_writer

W, H = 128, 96  # four 64x48 patches
PATCHES = np.array([[200, 40, 30], [30, 180, 60], [40, 60, 210], [128, 128, 128]]) / 255
# name -> (matrix, primaries, transfer, range, bits): FFmpeg's codes
SOURCES = {"bt709": (1, 1, 1, 1, 8), "bt601": (6, 6, 6, 1, 8), "full-range": (1, 1, 1, 2, 8),
           "bt2020-pq": (9, 9, 16, 1, 10), "bt2020-hlg": (9, 9, 18, 1, 10)}
# The largest coefficient from a chroma sample to R, G or B, 2 (1 - Kb), per matrix.
CHROMA_GAIN = {1: 2 * (1 - 0.0722), 6: 2 * (1 - 0.114), 9: 2 * (1 - 0.0593)}


def _patch_frame() -> np.ndarray:
    frame = np.zeros((H, W, 3), np.uint16)
    for index, colour in enumerate(PATCHES):
        row, column = divmod(index, 2)
        frame[row * 48:(row + 1) * 48, column * 64:(column + 1) * 64] = np.round(colour * 65535)
    return frame


def make_source(path, name: str, frames: int = 3) -> None:
    """Flat patches converted to YUV by the source's own matrix and range, losslessly
    encoded (x264 qp 0, x265 lossless), tagged with the full description."""
    matrix, primaries, transfer, colour_range, bits = SOURCES[name]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264" if bits == 8 else "libx265", rate=25)
        stream.width, stream.height = W, H
        stream.pix_fmt = "yuv420p" if bits == 8 else "yuv420p10le"
        stream.options = {"qp": "0"} if bits == 8 else \
            {"x265-params": "lossless=1:log-level=error"}
        cc = stream.codec_context
        cc.colorspace, cc.color_primaries, cc.color_trc = matrix, primaries, transfer
        cc.color_range = colour_range
        rgb = av.VideoFrame.from_ndarray(_patch_frame(), format="rgb48le")
        for index in range(frames):
            picture = rgb.reformat(format=stream.pix_fmt, dst_colorspace={6: 5}.get(matrix, matrix),
                                   dst_color_range=colour_range)
            picture.pts = index
            out.mux(stream.encode(picture))
        out.mux(stream.encode(None))


def stream_tags(path) -> tuple[int, int, int, int]:
    with av.open(str(path)) as container:
        cc = container.streams.video[0].codec_context
        return cc.colorspace, cc.color_primaries, cc.color_trc, cc.color_range


def patch_colours(path) -> np.ndarray:
    """Each patch's interior (16 px from its edges: no chroma or block edge reaches it), as
    decoded by the reader, in [0, 1]: (patch, pixel, channel)."""
    with open_media(path) as media:
        frame = next(iter(media.frames()))
    top = 65535 if frame.dtype == np.uint16 else 255
    return np.stack([frame[row * 48 + 16:row * 48 + 32, column * 64 + 16:column * 64 + 48]
                     .reshape(-1, 3) / top for row in range(2) for column in range(2)])


def rounding_bound(name: str, array_bits: int) -> float:
    """How far one trip RGB -> YUV at the source's bit depth -> RGB moves a channel: a code
    step of luma plus a step of chroma times the largest chroma coefficient, then a step of
    the RGB array the reader returns (``array_bits``). Whole steps, not half: swscale's
    fixed-point conversions round to within one step, not to the nearest."""
    matrix, _, _, colour_range, bits = SOURCES[name]
    steps = 2 ** (bits - 8)
    luma = 1 / (2 ** bits - 1) if colour_range == 2 else 1 / (219 * steps)
    chroma = 1 / (2 ** bits - 1) if colour_range == 2 else 1 / (224 * steps)
    return luma + CHROMA_GAIN[matrix] * chroma + 1 / (2 ** array_bits - 1)


@pytest.mark.parametrize("name", list(SOURCES))
def test_the_colour_description_and_the_colours_survive(tmp_path, name):
    source, output = tmp_path / f"{name}.mkv", tmp_path / f"{name}_out.mkv"
    make_source(source, name)
    with open_media(source) as media:
        info, frames = media.info, list(media.frames())
    codec = "h265" if SOURCES[name][4] == 10 else "h264"
    with open_writer(output, OutputSpec(codec=codec, crf=0), like=info) as writer:
        writer.write_many(frames)
    assert stream_tags(output) == stream_tags(source) == SOURCES[name][:4]
    bound = rounding_bound(name, info.bit_depth)
    error = np.abs(patch_colours(output) - patch_colours(source)).max()
    assert error <= bound, error
    # The source decodes to the patches it was made of (the reader reads its tags).
    assert np.abs(patch_colours(source) - PATCHES[:, None]).max() <= bound
    colour = info.colour
    assert (colour.matrix, colour.primaries, colour.transfer, colour.range) == SOURCES[name][:4]


def _pq_source(tmp_path):
    source = tmp_path / "hdr.mkv"
    make_source(source, "bt2020-pq", frames=1)
    with open_media(source) as media:
        return media.info


@pytest.mark.parametrize("name,codec,written", [("out.mp4", "h264", "H264"),
                                                ("out.webm", "h264", "VP9"),
                                                ("out.mkv", "vp9", "VP9")])
def test_hdr_is_never_written_in_8_bits(tmp_path, name, codec, written):
    info = _pq_source(tmp_path)
    with pytest.raises(MediaError) as caught:
        open_writer(tmp_path / name, OutputSpec(codec=codec), like=info)
    assert str(caught.value) == (
        f"{tmp_path / name}: the source is HDR video (PQ, SMPTE ST 2084), which needs 10 bits, "
        f"and {written} is written in 8 bits here; give codec h265 (10-bit) and a .mkv, .mp4 "
        f"or .mov name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hdr.mkv"]


@pytest.mark.parametrize("name", ["still.png", "frames/", "%05d.png", "out.jpg"])
def test_hdr_to_images_is_refused_in_one_line(tmp_path, name):
    """No tone mapping: PQ code values shown as sRGB would look washed out."""
    info = _pq_source(tmp_path)
    with pytest.raises(MediaError) as caught:
        open_writer(f"{tmp_path}/{name}", like=info)
    assert str(caught.value) == (
        f"{tmp_path / 'hdr.mkv'} is HDR video (PQ, SMPTE ST 2084) and "
        f"{tmp_path / name.rstrip('/')} (an image output) is SDR; this pack does not tone-map: "
        f"write a video with codec h265 (.mkv, .mp4 or .mov) to keep it HDR")


def test_hdr_to_an_image_batch_is_refused_in_one_line(tmp_path):
    from seedvr2.workflow.core_nodes import Video, video_components

    info = _pq_source(tmp_path)
    with pytest.raises(MediaError) as caught:
        video_components(Video(path=info.path))
    assert str(caught.value) == (
        f"{info.path} is HDR video (PQ, SMPTE ST 2084) and an IMAGE batch is SDR; this pack "
        f"does not tone-map: write a video with codec h265 (.mkv, .mp4 or .mov) to keep it HDR")


def test_an_upscaled_hdr_video_stays_hdr(tiny_options, tmp_path, capsys):
    from test_upscale_cli import _args

    from seedvr2.cli import main

    source, output = tmp_path / "hdr.mkv", tmp_path / "out.mkv"
    make_source(source, "bt2020-pq")
    assert main(_args(tiny_options, str(source), "-o", str(output), "--codec", "h265")) == 0
    assert stream_tags(output) == SOURCES["bt2020-pq"][:4]
    with av.open(str(output)) as container:
        assert container.streams.video[0].codec_context.pix_fmt == "yuv420p10le"
    # The default codec, H.264, is refused before any model loads.
    capsys.readouterr()
    args = _args(tiny_options, str(source), "-o", str(tmp_path / "default.mkv"))
    args[args.index("--dit") + 1] = str(tmp_path / "missing.safetensors")
    assert main(args) == 1
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'default.mkv'}: the source is HDR video (PQ, SMPTE ST 2084), "
        f"which needs 10 bits, and H264 is written in 8 bits here; give codec h265 (10-bit) "
        f"and a .mkv, .mp4 or .mov name\n")
