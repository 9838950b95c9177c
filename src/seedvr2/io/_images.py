"""Still images: probe, decode and encode single files. Pillow handles 8-bit images (and
EXIF orientation); 16-bit PNG and TIFF go through FFmpeg's png/tiff codecs, as Pillow would cut
them to 8 bits. Gray + alpha becomes RGBA (the pipeline handles 1, 3 or 4 channels)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._common import ARRAY_FORMATS, MediaError, to_8bit, to_picture, with_channels

# Pillow mode -> (mode to convert to or None, channels, bit depth). "P" is decided per file.
_PIL_MODES = {
    "1": ("L", 1, 8), "L": (None, 1, 8), "LA": ("RGBA", 4, 8), "La": ("RGBA", 4, 8),
    "PA": ("RGBA", 4, 8), "RGB": (None, 3, 8), "RGBA": (None, 4, 8), "RGBa": ("RGBA", 4, 8),
    "RGBX": ("RGB", 3, 8), "CMYK": ("RGB", 3, 8), "YCbCr": ("RGB", 3, 8), "LAB": ("RGB", 3, 8),
    "HSV": ("RGB", 3, 8), "I;16": (None, 1, 16), "I;16L": (None, 1, 16),
    "I;16B": (None, 1, 16), "I;16N": (None, 1, 16), "I": (None, 1, 16),
}
# PNG IHDR colour type -> channels after our conversions (4 = gray+alpha becomes RGBA).
_PNG_COLOUR_CHANNELS = {0: 1, 2: 3, 3: 3, 4: 4, 6: 4}
_EXIF_ORIENTATION = 0x0112
# zlib level for PNG: saving runs in the pipeline's thread, and levels above 3 cost 2-5x the
# time (a 1080p 16-bit frame: 0.6 s at 3, 1.9 s at 6) for files only a few percent smaller.
PNG_COMPRESS_LEVEL = 3


@dataclass(frozen=True)
class ImageProbe:
    """Header facts about one image file; ``decoder`` is "pillow" or an FFmpeg codec name."""

    width: int
    height: int
    channels: int
    bit_depth: int
    decoder: str
    mode: str  # Pillow mode or "png16"/"tiff16": compared across a sequence's files
    fmt: str  # Pillow format name from the file's signature
    frames: int = 1  # more than one: an animated WebP/PNG or a multi-page TIFF


def probe_image(path: Path, fmt: str) -> ImageProbe:
    """Read only the header of ``path`` (already sniffed as Pillow format ``fmt``)."""
    if fmt == "PNG":
        # Pillow reports a 16-bit RGB PNG as plain "RGB", so read bit depth from the IHDR chunk.
        with open(path, "rb") as f:
            head = f.read(33)
        if len(head) < 33 or head[12:16] != b"IHDR":
            raise MediaError(f"{path}: corrupt PNG (no IHDR header)")
        width, height, depth, colour = struct.unpack(">IIBB", head[16:26])
        if depth == 16:
            if colour not in _PNG_COLOUR_CHANNELS:
                raise MediaError(f"{path}: corrupt PNG (colour type {colour})")
            return ImageProbe(width, height, _PNG_COLOUR_CHANNELS[colour], 16, "png", "png16",
                              fmt, _apng_frames(path))
    from PIL import Image

    try:
        with Image.open(path) as im:
            mode, (width, height), layout = im.mode, im.size, _pillow_layout(im)
            bits = im.tag_v2.get(258, (8,)) if fmt == "TIFF" else (8,)
            # PNG keeps EXIF after the pixels, so asking for it decodes the whole image: too slow
            # for probing long sequences, and PNGs with an orientation tag are rare.
            orientation = im.getexif().get(_EXIF_ORIENTATION, 1) if fmt != "PNG" else 1
            frames = getattr(im, "n_frames", 1)
    except Exception as e:  # Pillow raises several types for broken headers
        raise MediaError(f"{path}: cannot read image: {e}") from e
    if fmt == "TIFF" and max(bits) > 8 and len(bits) >= 3:
        return ImageProbe(width, height, min(len(bits), 4), 16, "tiff", "tiff16", fmt, frames)
    if orientation in (5, 6, 7, 8):  # 90-degree EXIF rotations swap the displayed size
        width, height = height, width
    if layout is None:
        raise MediaError(f"{path}: unsupported image mode {mode!r} "
                         f"(supported: gray, gray+alpha, RGB, RGBA, CMYK at 8 or 16 bits)")
    return ImageProbe(width, height, *layout, "pillow", mode, fmt, frames)


def _pillow_layout(im) -> tuple[int, int] | None:
    """(channels, bit depth) of a Pillow image after our conversions; None for a mode we
    don't read. A palette image is RGB, or RGBA with a transparent colour."""
    if im.mode == "P":
        return 4 if "transparency" in im.info else 3, 8
    return _PIL_MODES[im.mode][1:] if im.mode in _PIL_MODES else None


def _apng_frames(path: Path) -> int:
    """Frames of a PNG: the animation control chunk's count (APNG), else 1. The chunk must
    come before the image data, so only the header chunks are read."""
    with open(path, "rb") as f:
        f.seek(8)
        while True:
            head = f.read(8)
            if len(head) < 8:
                return 1
            length, kind = struct.unpack(">I4s", head)
            if kind == b"acTL":
                count = f.read(4)
                return max(1, struct.unpack(">I", count)[0]) if len(count) == 4 else 1
            if kind == b"IDAT":
                return 1
            f.seek(length + 4, 1)  # data and CRC


@dataclass(frozen=True)
class AnimationScan:
    """What decoding every frame of an animated image found (see :func:`scan_animation`)."""

    width: int
    height: int
    channels: int
    durations: tuple | None  # seconds (Fractions) per frame; None: the format has no timing
    loop: int | None  # plays this many times, 0 forever; None: the format has no loop count


# EXIF orientation -> Pillow transpose method name, to turn the picture upright.
_EXIF_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE",
                   6: "ROTATE_270", 7: "TRANSVERSE", 8: "ROTATE_90"}
_MODE_OF_CHANNELS = {1: "L", 3: "RGB", 4: "RGBA"}


def scan_animation(path: Path, probe: ImageProbe) -> AnimationScan:
    """Decode every frame of a multi-frame image once: a damaged frame, pages of different sizes and
    16-bit pages are refused here, before any work; each frame's duration and the widest channel
    layout of all frames (one RGBA frame makes every frame RGBA) are learned."""
    from fractions import Fraction

    from PIL import Image

    what = "multi-page TIFF" if probe.fmt == "TIFF" else f"animated {probe.fmt}"
    if probe.bit_depth == 16:
        raise MediaError(f"{path}: a 16-bit {what} can't be read at full precision (its "
                         f"frames would be cut to 8 bits); save the frames as 16-bit PNG "
                         f"files and pass the folder")
    channels, durations, size = 1, [], None
    try:
        with Image.open(path) as im:
            loop = im.info.get("loop")
            for index in range(probe.frames):
                im.seek(index)
                im.load()  # WebP sets a frame's duration only once it is decoded
                if size is None:
                    size = im.size
                elif im.size != size:
                    raise MediaError(f"{path}: frame {index} of this {what} is "
                                     f"{im.size[0]}x{im.size[1]}, frame 0 is "
                                     f"{size[0]}x{size[1]}; every frame needs the same size")
                layout = _pillow_layout(im)
                if layout is None or layout[1] != 8:
                    raise MediaError(f"{path}: frame {index} of this {what} has pixel mode "
                                     f"{im.mode!r}; animations are read as 8-bit gray, RGB or RGBA")
                channels = max(channels, layout[0])
                duration = im.info.get("duration")
                durations.append(None if duration is None else
                                 Fraction(duration).limit_denominator(1000) / 1000)
    except MediaError:
        raise
    except Exception as e:  # Pillow raises several types for damaged frames
        raise MediaError(f"{path}: cannot decode frame {len(durations)} of this {what}: {e}") from e
    timed = probe.fmt != "TIFF" and None not in durations
    return AnimationScan(probe.width, probe.height, channels,
                         tuple(durations) if timed else None,
                         loop if timed and isinstance(loop, int) else None)


def animation_frames(path: Path, probe: ImageProbe, channels: int, start: int,
                     stop: int | None):
    """Frames ``start`` .. ``stop - 1`` of a multi-frame image as (H, W, C) uint8 arrays,
    one decoded at a time. Every frame is turned upright as the first one's EXIF says."""
    from PIL import Image

    with Image.open(path) as im:
        turn = _EXIF_TRANSPOSE.get(im.getexif().get(_EXIF_ORIENTATION, 1)) \
            if probe.fmt != "PNG" else None
        for index in range(start, probe.frames if stop is None else min(stop, probe.frames)):
            try:
                im.seek(index)
                frame = im.convert(_MODE_OF_CHANNELS[channels])
            except Exception as e:  # noqa: BLE001 -- name the frame whatever went wrong
                raise MediaError(f"{path}: cannot decode frame {index}: {e}") from e
            if turn is not None:
                frame = frame.transpose(getattr(Image.Transpose, turn))
            yield with_channels(np.array(frame))


def save_animation(path: Path, frames, fmt: str, durations, loop: int, quality: int) -> None:
    """Write 8-bit (H, W, C) ``frames`` as one animated ``fmt`` file: a PNG or WebP showing frame
    ``i`` for ``durations[i]`` seconds (whole milliseconds, as both store them) and playing ``loop``
    times (0: forever), or a multi-page TIFF (no timing). Encoders merge a frame into an identical
    one before it, shown for both durations: the animation looks the same."""
    images = [_pillow_image(frame, fmt) for frame in frames]
    options = {"save_all": True, "append_images": images[1:], **_encoder_options(fmt, quality)}
    if durations is not None and fmt != "TIFF":
        options.update(duration=[round(d * 1000) for d in durations], loop=loop)
    if fmt == "PNG":
        # Each frame replaces the last, as decoded (blending over it would mix two frames' alpha).
        options.update(disposal=0, blend=0)
    images[0].save(path, format=fmt, **options)


def load_image(path: Path, probe: ImageProbe) -> np.ndarray:
    """Decode ``path`` to an (H, W, C) uint8/uint16 array as described by ``probe``."""
    if probe.decoder != "pillow":
        return _load_ffmpeg(path, probe)
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            im.load()
            if probe.fmt != "PNG":  # same rule as probe_image, so the sizes agree
                im = ImageOps.exif_transpose(im)
    except Exception as e:
        raise MediaError(f"{path}: cannot decode image: {e}") from e
    if im.mode == "P":
        im = im.convert("RGBA" if probe.channels == 4 else "RGB")
    elif _PIL_MODES[im.mode][0] is not None:
        im = im.convert(_PIL_MODES[im.mode][0])
    array = np.array(im)  # writable: the pipeline hands frames to torch.from_numpy
    if im.mode == "I":  # 32-bit integer gray: keep the 16-bit range it almost always holds
        array = np.clip(array, 0, 65535)
    return with_channels(array.astype(np.uint16 if probe.bit_depth == 16 else np.uint8,
                                      copy=False))


def _load_ffmpeg(path: Path, probe: ImageProbe) -> np.ndarray:
    import av

    try:
        codec = av.CodecContext.create(probe.decoder, "r")
        frames = codec.decode(av.Packet(path.read_bytes())) + codec.decode(None)
        if not frames:
            raise MediaError("no picture decoded")
        array = frames[0].to_ndarray(format=ARRAY_FORMATS[probe.channels, 16])
    except (av.FFmpegError, MediaError) as e:
        raise MediaError(f"{path}: cannot decode image: {e}") from e
    return with_channels(array)


def save_image(path: Path, frame: np.ndarray, fmt: str, quality: int) -> None:
    """Encode (H, W, C) ``frame`` as Pillow format ``fmt`` to ``path``: 16-bit frames stay 16-bit in
    PNG and TIFF (FFmpeg's encoders); other formats get :func:`_pillow_image`'s frame (the writer
    warns of what is lost when it is opened)."""
    if frame.dtype == np.uint16 and fmt in ("PNG", "TIFF"):
        _save_ffmpeg(path, frame, fmt)
        return
    _pillow_image(frame, fmt).save(path, format=fmt, **_encoder_options(fmt, quality))


def _encoder_options(fmt: str, quality: int) -> dict:
    """Pillow's encoder options for ``fmt``; ``quality`` (1-100) for the lossy ones."""
    return {"PNG": {"compress_level": PNG_COMPRESS_LEVEL},
            "JPEG": {"quality": quality, "subsampling": 0},  # 4:4:4: don't blur upscaled chroma
            "WEBP": {"quality": quality, "method": 4},
            "TIFF": {"compression": "tiff_deflate"}}[fmt]


def _pillow_image(frame: np.ndarray, fmt: str):
    """The Pillow image of an (H, W, C) ``frame`` that ``fmt`` can hold: 8 bits (16-bit frames
    rounded), no alpha in JPEG (dropped), no gray in WebP (stored as RGB)."""
    from PIL import Image

    frame = to_8bit(frame)
    if fmt == "JPEG" and frame.shape[2] == 4:
        frame = frame[:, :, :3]
    if fmt == "WEBP" and frame.shape[2] == 1:
        frame = np.repeat(frame, 3, axis=2)
    return Image.fromarray(frame[:, :, 0] if frame.shape[2] == 1 else frame)


def _save_ffmpeg(path: Path, frame: np.ndarray, fmt: str) -> None:
    from fractions import Fraction

    import av

    height, width, channels = frame.shape
    source = ARRAY_FORMATS[channels, 16]
    # PNG stores big-endian samples; FFmpeg's png encoder only takes the *be formats.
    target = source.replace("le", "be") if fmt == "PNG" else source
    codec = av.CodecContext.create("png" if fmt == "PNG" else "tiff", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, target
    codec.time_base = Fraction(1, 1)
    codec.options = ({"compression_algo": "deflate"} if fmt == "TIFF"
                     else {"compression_level": str(PNG_COMPRESS_LEVEL)})
    packets = codec.encode(to_picture(frame).reformat(format=target)) + codec.encode(None)
    with open(path, "wb") as f:
        for packet in packets:
            f.write(bytes(packet))
