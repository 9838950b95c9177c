"""Shared pieces of :mod:`seedvr2.io`: the error type, :class:`MediaInfo`, file-type tables and the
readers' and writers' small helpers. PyAV and Pillow load inside the functions that need them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from ..errors import SeedVR2Error

# Extensions decide the *output* kind. For input, content (magic bytes) wins over the extension:
# a PNG named .jpg or a video named .png still opens with the right decoder (sniff_image).
VIDEO_EXTENSIONS = {".mp4": "mp4", ".m4v": "mp4", ".mov": "mov", ".mkv": "matroska",
                    ".webm": "webm"}
IMAGE_EXTENSIONS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP",
                    ".tif": "TIFF", ".tiff": "TIFF", ".bmp": "BMP"}


class MediaError(SeedVR2Error, ValueError):
    """A media file or folder can't be read or written as asked; the message names the path.
    Refusing to replace an existing output is an :class:`~seedvr2.errors.OutputExists` instead."""

# FFmpeg's YUV matrix code (AVColorSpace) -> the one swscale converts with (BT.601's 5 and 6 have
# the same coefficients); sources in others (YCgCo, constant-luminance BT.2020, ICtCp) get BT.709.
_WRITABLE_MATRICES = {1: 1, 4: 4, 5: 5, 6: 5, 7: 7, 9: 9}
_HDR_TRANSFERS = {16: "PQ, SMPTE ST 2084", 18: "HLG, ARIB STD-B67"}


@dataclass(frozen=True)
class Colour:
    """A video's colour description in FFmpeg's codes: YUV ``matrix`` (AVColorSpace), ``primaries``,
    ``transfer`` (AVColorTransferCharacteristic), ``range`` (1 limited, 2 full). Defaults: BT.709
    limited range, for sources without one (images; untagged video, converted as players assume)."""

    matrix: int = 1
    primaries: int = 1
    transfer: int = 1
    range: int = 1

    @classmethod
    def tagged(cls, matrix: int, primaries: int, transfer: int, colour_range: int) -> Colour:
        """The description of a source's tags; each one unspecified (or a matrix this
        FFmpeg cannot write) takes BT.709 limited range's."""
        default = cls()
        return cls(matrix if matrix in _WRITABLE_MATRICES else default.matrix,
                   primaries if primaries not in (0, 2) else default.primaries,
                   transfer if transfer not in (0, 2) else default.transfer,
                   colour_range if colour_range in (1, 2) else default.range)

    @property
    def conversion_matrix(self) -> int:
        """The swscale matrix that converts RGB to this description's YUV."""
        return _WRITABLE_MATRICES[self.matrix]

    @property
    def hdr(self) -> str | None:
        """The HDR transfer's name (PQ, HLG), or None for SDR."""
        return _HDR_TRANSFERS.get(self.transfer)


def refuse_hdr(info: MediaInfo | None, into: str) -> None:
    """Raise a MediaError when ``info``'s source is HDR and ``into`` (what its frames become) is
    SDR: without tone mapping, PQ or HLG values shown as SDR look washed out."""
    if info is not None and info.colour.hdr:
        raise MediaError(f"{info.path} is HDR video ({info.colour.hdr}) and {into} is SDR; "
                         f"this pack does not tone-map: write a video with codec h265 (.mkv, "
                         f".mp4 or .mov) to keep it HDR")


@dataclass(frozen=True)
class MediaInfo:
    """What a reader found, or what a writer given ``like=`` reproduces (docs/media.md#reading).
    ``frame_count`` is exact if ``frame_count_exact`` (:meth:`VideoReader.count_frames` makes it
    so); ``frame_times`` is None at a constant rate (frame i at i / fps)."""

    kind: str
    path: str
    frame_count: int
    width: int
    height: int
    channels: int
    bit_depth: int
    fps: Fraction | None = None
    has_audio: bool = False
    frame_count_exact: bool = True
    codec: str | None = None
    rotation: int = 0
    frame_times: tuple[Fraction, ...] | None = field(default=None, repr=False)
    # (index, type, codec) of each stream but the video read and audio, e.g. (2, "subtitle",
    # "subrip"): video writers copy the subtitles their container holds, and name the rest.
    other_streams: tuple[tuple[int, str, str], ...] = ()
    mirrored: bool = False
    pixel_aspect: Fraction = Fraction(1)
    frame_durations: tuple[Fraction, ...] | None = field(default=None, repr=False)
    loop: int | None = None
    colour: Colour = Colour()


@dataclass(frozen=True)
class DisplayTransform:
    """How stored frames are shown: scaled to square pixels, rotated counter-clockwise by
    ``rotation`` degrees (a multiple of 90), then flipped left-right if ``mirrored``. Image
    files have neither tag, so image writers apply it to every frame; square pixels are
    reached by enlarging, never shrinking, so no upscaled detail is lost."""

    rotation: int = 0
    mirrored: bool = False
    pixel_aspect: Fraction = Fraction(1)

    @classmethod
    def of(cls, info: MediaInfo | None) -> DisplayTransform | None:
        """The transform of ``info``'s source, or None when frames are shown as stored."""
        if info is None or (not info.rotation % 360 and not info.mirrored
                            and info.pixel_aspect == 1):
            return None
        return cls(info.rotation % 360, info.mirrored, info.pixel_aspect)

    def apply(self, frame: np.ndarray) -> np.ndarray:
        """The (H, W, C) stored ``frame`` as shown."""
        height, width = frame.shape[:2]
        if self.pixel_aspect != 1:
            frame = resize(frame, *self._square(width, height))
        frame = np.rot90(frame, self.rotation // 90)  # rot90 turns counter-clockwise
        if self.mirrored:
            frame = frame[:, ::-1]
        return np.ascontiguousarray(frame)

    def _square(self, width: int, height: int) -> tuple[int, int]:
        if self.pixel_aspect > 1:
            return max(1, round(width * self.pixel_aspect)), height
        if self.pixel_aspect < 1:
            return width, max(1, round(height / self.pixel_aspect))
        return width, height


# FFmpeg pixel formats of (H, W, C) frames, by (channels, bit depth).
ARRAY_FORMATS = {(1, 8): "gray", (3, 8): "rgb24", (4, 8): "rgba",
                 (1, 16): "gray16le", (3, 16): "rgb48le", (4, 16): "rgba64le"}


def to_picture(frame: np.ndarray):
    """The PyAV picture of an (H, W, C) uint8/uint16 array, in its :data:`ARRAY_FORMATS`."""
    from av import VideoFrame

    channels = frame.shape[2]
    return VideoFrame.from_ndarray(
        np.ascontiguousarray(frame[:, :, 0] if channels == 1 else frame),
        format=ARRAY_FORMATS[channels, 16 if frame.dtype == np.uint16 else 8])


def with_channels(array: np.ndarray) -> np.ndarray:
    """A decoded (H, W) or (H, W, C) array as (H, W, C): gray gets its channel axis back."""
    return array[:, :, None] if array.ndim == 2 else array


def resize(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    """``frame`` resampled to ``width`` x ``height`` (Lanczos, FFmpeg's swscale: it handles
    every channel count at 8 and 16 bits, which Pillow does not)."""
    picture = to_picture(frame).reformat(width=width, height=height, interpolation="LANCZOS")
    return with_channels(picture.to_ndarray())


def sniff_image(path: Path) -> str | None:
    """Pillow format name if the file's first bytes are a still-image signature, else None; a
    MediaError naming ``path`` when it can't be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise MediaError(f"{path}: cannot read file: {e.strerror or e}") from e
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if head[:2] == b"BM":
        return "BMP"
    return None


def as_fraction(fps) -> Fraction:
    """An exact frame rate from an int, Fraction, ``"30000/1001"`` or float. Floats are snapped to
    the nearest rate with a small denominator so 29.97 becomes 30000/1001 and 23.976 becomes
    24000/1001, as every tool means by them."""
    if isinstance(fps, Fraction):
        rate = fps
    elif isinstance(fps, (int, str)):
        rate = Fraction(fps)
    else:
        rate = Fraction(float(fps))
        for den in (1, 1001, 100, 1000):
            candidate = Fraction(round(float(fps) * den), den)
            if abs(float(candidate) - float(fps)) < 5e-4:
                rate = candidate
                break
    if rate <= 0:
        raise MediaError(f"frame rate must be positive, got {fps!r}")
    return rate


def to_8bit(frame: np.ndarray) -> np.ndarray:
    """16-bit -> 8-bit with rounding (65535 -> 255, 32896 -> 128); 8-bit passes through."""
    if frame.dtype == np.uint8:
        return frame
    return ((frame.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)


# printf's frame number in a pattern: %d, %5d, %05d ([0-9]: re's \d matches other scripts' digits).
PRINTF = re.compile(r"%(0?)([0-9]*)d")
MAX_NUMBER_WIDTH = 20  # digits of a frame number: 2^64 has 20


def printf_pattern(pattern: Path) -> tuple[str, str, str]:
    """(prefix, number spec, suffix) of a file name pattern like ``%05d.png``: the one syntax
    of sequence patterns, read and written (``%%`` is a literal ``%``)."""
    name = pattern.name
    matches = list(PRINTF.finditer(name))
    if len(matches) != 1 or "%" in name.replace(matches[0][0], "", 1).replace("%%", ""):
        raise MediaError(f"{pattern}: a sequence pattern needs exactly one %d, %05d or "
                         f"similar, in the file name")
    m = matches[0]
    if m[2] and int(m[2]) > MAX_NUMBER_WIDTH:
        raise MediaError(f"{pattern}: {m[0]} pads frame numbers to {int(m[2])} digits; at most "
                         f"{MAX_NUMBER_WIDTH} are meaningful (%05d pads to 5)")
    return name[:m.start()].replace("%%", "%"), m[0], name[m.end():].replace("%%", "%")


def writable_folder(folder: Path) -> None:
    """Raise a MediaError naming ``folder`` unless it exists and is a directory."""
    if not folder.exists():
        raise MediaError(f"output folder {folder} does not exist; create it first")
    if not folder.is_dir():
        raise MediaError(f"output folder {folder} is not a directory")


def fspath(path) -> Path:
    """Path from str/PathLike, with ``~`` expanded (users type it in configs and UIs)."""
    return Path(os.path.expanduser(os.fspath(path)))
