"""Still images: probe, decode and encode single files.

Pillow handles 8-bit images (and applies EXIF orientation, which phone JPEGs rely on). Pillow
cannot hold 16-bit colour -- it silently reduces a 16-bit RGB PNG to 8 bits -- so 16-bit PNG
and TIFF go through FFmpeg's png/tiff codecs (bundled with PyAV) instead, at full precision.
Two-channel images (gray + alpha) become RGBA: lossless, and the pipeline only handles 1, 3
or 4 channels.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._common import MediaError

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
# FFmpeg pixel formats for 16-bit frames with 1, 3 or 4 channels (native little-endian arrays).
FFMPEG_16BIT_FORMATS = {1: "gray16le", 3: "rgb48le", 4: "rgba64le"}
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
                              fmt)
    from PIL import Image

    try:
        with Image.open(path) as im:
            mode, (width, height) = im.mode, im.size
            transparent = "transparency" in im.info
            bits = im.tag_v2.get(258, (8,)) if fmt == "TIFF" else (8,)
            # PNG keeps EXIF after the pixels, so asking for it decodes the whole image: too slow
            # for probing long sequences, and PNGs with an orientation tag are rare.
            orientation = im.getexif().get(_EXIF_ORIENTATION, 1) if fmt != "PNG" else 1
    except Exception as e:  # Pillow raises several types for broken headers
        raise MediaError(f"{path}: cannot read image: {e}") from e
    if fmt == "TIFF" and max(bits) > 8 and len(bits) >= 3:
        return ImageProbe(width, height, min(len(bits), 4), 16, "tiff", "tiff16", fmt)
    if orientation in (5, 6, 7, 8):  # 90-degree EXIF rotations swap the displayed size
        width, height = height, width
    if mode == "P":
        return ImageProbe(width, height, 4 if transparent else 3, 8, "pillow", mode, fmt)
    if mode not in _PIL_MODES:
        raise MediaError(f"{path}: unsupported image mode {mode!r} "
                         f"(supported: gray, gray+alpha, RGB, RGBA, CMYK at 8 or 16 bits)")
    _, channels, depth = _PIL_MODES[mode]
    return ImageProbe(width, height, channels, depth, "pillow", mode, fmt)


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
    array = array.astype(np.uint16 if probe.bit_depth == 16 else np.uint8, copy=False)
    return array[:, :, None] if array.ndim == 2 else array


def _load_ffmpeg(path: Path, probe: ImageProbe) -> np.ndarray:
    import av

    try:
        codec = av.CodecContext.create(probe.decoder, "r")
        frames = codec.decode(av.Packet(path.read_bytes())) + codec.decode(None)
        if not frames:
            raise MediaError("no picture decoded")
        array = frames[0].to_ndarray(format=FFMPEG_16BIT_FORMATS[probe.channels])
    except (av.FFmpegError, MediaError) as e:
        raise MediaError(f"{path}: cannot decode image: {e}") from e
    return array[:, :, None] if array.ndim == 2 else array


def save_image(path: Path, frame: np.ndarray, fmt: str, quality: int) -> None:
    """Encode (H, W, C) ``frame`` as Pillow format ``fmt`` to ``path``.

    16-bit frames stay 16-bit in PNG and TIFF (via FFmpeg's encoders); JPEG and WebP are
    8-bit formats, so 16-bit frames are rounded to 8 bits. JPEG has no alpha: it is dropped
    (the writer warns when it is opened). WebP has no gray: gray is stored as RGB.
    """
    channels = frame.shape[2]
    if frame.dtype == np.uint16 and fmt in ("PNG", "TIFF"):
        _save_ffmpeg(path, frame, fmt)
        return
    from PIL import Image

    from ._common import to_8bit

    frame = to_8bit(frame)
    if fmt == "JPEG" and channels == 4:
        frame = frame[:, :, :3]
    if fmt == "WEBP" and channels == 1:
        frame = np.repeat(frame, 3, axis=2)
    image = Image.fromarray(frame[:, :, 0] if frame.shape[2] == 1 else frame)
    options = {
        "PNG": {"compress_level": PNG_COMPRESS_LEVEL},
        "JPEG": {"quality": quality, "subsampling": 0},  # 4:4:4: don't blur upscaled chroma
        "WEBP": {"quality": quality, "method": 4},
        "TIFF": {"compression": "tiff_deflate"},
    }[fmt]
    image.save(path, format=fmt, **options)


def _save_ffmpeg(path: Path, frame: np.ndarray, fmt: str) -> None:
    from fractions import Fraction

    import av

    height, width, channels = frame.shape
    source = FFMPEG_16BIT_FORMATS[channels]
    # PNG stores big-endian samples; FFmpeg's png encoder only takes the *be formats.
    target = source.replace("le", "be") if fmt == "PNG" else source
    codec = av.CodecContext.create("png" if fmt == "PNG" else "tiff", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, target
    codec.time_base = Fraction(1, 1)
    codec.options = ({"compression_algo": "deflate"} if fmt == "TIFF"
                     else {"compression_level": str(PNG_COMPRESS_LEVEL)})
    picture = av.VideoFrame.from_ndarray(
        np.ascontiguousarray(frame[:, :, 0] if channels == 1 else frame), format=source)
    packets = codec.encode(picture.reformat(format=target)) + codec.encode(None)
    with open(path, "wb") as f:
        for packet in packets:
            f.write(bytes(packet))
