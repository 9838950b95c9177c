"""Writers: frames in, a video / an image / numbered images out, without ever losing work.

:func:`open_writer` picks the writer from the destination. Every writer builds its output under a
hidden temporary name and moves it into place at close, replaces an existing output only with
``overwrite=True``, and finds problems at open: docs/media.md#writing."""

from __future__ import annotations

import math
import os
import re
import shutil
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import numpy as np

from ..errors import OutputExists
from ..options import option_ref
from .temporaries import hold, remove_stale_temporaries, temporary_path
from ._common import (IMAGE_EXTENSIONS, PRINTF, VIDEO_EXTENSIONS, Colour, DisplayTransform,
                      MediaError, MediaInfo, as_fraction, fspath, printf_pattern,
                      refuse_hdr, to_picture, writable_folder)

# Image formats we write (BMP is read only).
_WRITE_IMAGE_FORMATS = {ext: fmt for ext, fmt in IMAGE_EXTENSIONS.items() if fmt != "BMP"}
# codec -> (FFmpeg encoder, codec name in container support lists, pixel format, default CRF,
# highest CRF, extra encoder options).
# H.265 is written 10-bit: it keeps 16-bit sources' extra precision and bands less.
# VP9 is what WebM holds, and it keeps alpha (yuva420p): transparent WebM in, transparent out.
# "b": "0" makes libvpx's crf a pure quality target rather than a cap under a bitrate.
# x264's macroblock-tree rate control reads memory it never wrote, so the first frames' quantisers
# change from run to run (issue 13): off, for outputs that repeat exactly (x265's cutree is fine).
_VIDEO_CODECS = {
    "h264": ("libx264", "h264", "yuv420p", 18, 51, {"x264-params": "mbtree=0"}),
    "h265": ("libx265", "hevc", "yuv420p10le", 20, 51, {"x265-params": "log-level=error"}),
    "vp9": ("libvpx-vp9", "vp9", "yuv420p", 24, 63, {"b": "0", "row-mt": "1",
                                                     "deadline": "good", "cpu-used": "4"}),
}
_CODEC_ALIASES = {"h264": "h264", "avc": "h264", "libx264": "h264", "x264": "h264",
                  "h265": "h265", "hevc": "h265", "libx265": "h265", "x265": "h265",
                  "vp9": "vp9", "libvpx-vp9": "vp9"}
_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow",
            "slower", "veryslow", "placebo")  # the same names in x264 and x265
# libx265 (PyAV 18.1's build) corrupts the heap encoding frames under 64 px wide: glibc
# aborts the process, 3 runs in 4 for three 42x32 clips in one process, never at 64x32.
H265_MIN_WIDTH = 64
_LAYOUT = ("width", "height", "channels", "bit_depth")
_FRAME_DTYPES = {8: np.uint8, 16: np.uint16}


@dataclass(frozen=True)
class OutputSpec:
    """The frames a writer takes and what it makes of them: (H, W, C) arrays of
    ``height x width x channels`` at ``bit_depth`` bits (uint8 or uint16; (H, W) for one channel).
    :func:`open_writer` takes each field left None from ``like`` (the source's :class:`MediaInfo`);
    a MediaInfo ``audio_from`` adds the ``subtitle_streams`` the container holds. Every field:
    docs/media.md#writing."""

    width: int | None = None
    height: int | None = None
    channels: int | None = None
    bit_depth: int | None = None
    fps: Fraction | float | str | None = None
    codec: str = "h264"
    crf: int | None = None
    preset: str | None = None
    quality: int = 95
    audio_from: Path | str | MediaInfo | None = None
    subtitle_streams: tuple[int, ...] = ()
    frame_times: tuple | None = None
    colour: Colour | None = None  # None: BT.709 limited range (Colour()) without like
    display: DisplayTransform | None = None
    upright: bool = True

    def resolved(self, path: Path, like: MediaInfo | None) -> OutputSpec:
        """This spec for the output ``path``, checked: each field left None taken from
        ``like``, and a MediaInfo ``audio_from`` replaced by the streams a video copies."""
        video = path.suffix.lower() in VIDEO_EXTENSIONS
        names = _LAYOUT + (("fps", "frame_times", "colour") if video else ())
        taken = {name: getattr(like, name) for name in names
                 if like is not None and getattr(self, name) is None}
        spec = replace(self, **taken, display=self.display or DisplayTransform.of(like))
        for name in _LAYOUT:
            if getattr(spec, name) is None:
                raise MediaError(f"open_writer: give OutputSpec({name}=...) (or like= a "
                                 f"MediaInfo to copy it from)")
        if spec.channels not in (1, 3, 4):
            raise MediaError(f"{path}: frames must have 1, 3 or 4 channels, not {spec.channels}")
        if spec.bit_depth not in (8, 16):
            raise MediaError(f"{path}: bit depth must be 8 or 16, not {spec.bit_depth}")
        if spec.width <= 0 or spec.height <= 0:
            raise MediaError(f"{path}: invalid frame size {spec.width}x{spec.height}")
        if not 1 <= spec.quality <= 100:
            raise MediaError(f"{path}: quality must be between 1 and 100, got {spec.quality}")
        if video and isinstance(spec.audio_from, MediaInfo):  # e.g. like=info, audio_from=info
            audio, subtitles = _carried_streams(spec.audio_from, path.suffix.lower())
            spec = replace(spec, audio_from=audio, subtitle_streams=subtitles)
        return spec


def open_writer(dst, spec: OutputSpec = OutputSpec(), *, like: MediaInfo | None = None,
                overwrite: bool = False) -> MediaWriter:
    """Open a writer of ``spec``'s frames at ``dst``, any field ``spec`` leaves out taken from
    ``like`` (typically the source's :class:`MediaInfo`; give the upscaled size in ``spec``); the
    destination picks the writer (docs/media.md#writing). Raises
    :class:`~seedvr2.errors.OutputExists` when the output exists and ``overwrite`` is false, and
    :class:`MediaError` for everything else that can be known before writing."""
    text, path = os.fspath(dst), fspath(dst)
    spec = spec.resolved(path, like)
    ext = path.suffix.lower()
    images = dict(overwrite=overwrite,
                  expected_frames=like.frame_count if like is not None else None)
    if ext not in VIDEO_EXTENSIONS:
        refuse_hdr(like, f"{path} (an image output)")
    if text.endswith(("/", os.sep)) or (path.is_dir() and ext not in VIDEO_EXTENSIONS
                                        and ext not in _WRITE_IMAGE_FORMATS):
        _warn_not_carried(path, like, spec, folder=True)
        return SequenceWriter(path, spec, **images)
    if path.is_dir():
        raise MediaError(f"{path} is a folder; give a file name, or end the path with '/' "
                         f"to write a PNG sequence into the folder")
    if PRINTF.search(path.name):
        if ext not in _WRITE_IMAGE_FORMATS:
            raise MediaError(f"{path}: a numbered pattern names image files, one per frame; "
                             f"give an image extension (e.g. {path.parent / '%05d.png'}), or "
                             f"a file name without %")
        _warn_not_carried(path, like, spec)
        return ImageWriter(path, spec, pattern=printf_pattern(path), **images)
    if ext in VIDEO_EXTENSIONS:
        if spec.fps is None:
            raise MediaError(f"{path}: a video needs a frame rate and images carry none; "
                             f"give one, e.g. {option_ref('fps', 24)} (or 29.97, 30000/1001)")
        _warn_not_carried(path, like, spec)
        return VideoWriter(path, spec, overwrite=overwrite)
    if ext in _WRITE_IMAGE_FORMATS:
        animation = _animation_of(path, like, spec.fps)
        _warn_not_carried(path, like, spec, animation)
        return ImageWriter(path, spec, animation=animation, **images)
    raise MediaError(
        f"{path}: can't tell what to write from the extension {ext or '(none)'!r}; use a video "
        f"extension ({', '.join(VIDEO_EXTENSIONS)}), an image one "
        f"({', '.join(_WRITE_IMAGE_FORMATS)}) or end the path with '/' for a PNG sequence folder")


# Subtitle codecs each output container stores as they are (no conversion between formats).
_SUBTITLE_CODECS = {".mkv": {"subrip", "srt", "ass", "ssa", "webvtt", "dvd_subtitle",
                             "hdmv_pgs_subtitle", "dvb_subtitle"},
                    ".webm": {"webvtt"},
                    ".mp4": {"mov_text"}, ".m4v": {"mov_text"}, ".mov": {"mov_text"}}
# Audio codecs FFmpeg lists for a container but refuses (or only writes as "experimental")
# when the header is written: caught at open with a message naming a container that works.
_AUDIO_REFUSED = {".mov": {"opus": ".mp4 or .mkv", "vorbis": ".mkv"},
                  ".mp4": {"vorbis": ".mkv"}, ".m4v": {"vorbis": ".mkv"}}


def _carried_streams(source: MediaInfo, ext: str) -> tuple[Path | None, tuple[int, ...]]:
    """What a video output ``ext`` copies from ``source``: the file to copy streams from
    (None: nothing to copy) and the indices of its subtitle streams the container holds."""
    subtitles = tuple(index for index, kind, codec in source.other_streams
                      if kind == "subtitle" and codec in _SUBTITLE_CODECS.get(ext, ()))
    return (source.path if source.has_audio or subtitles else None), subtitles


_ANIMATED_FORMATS = {"PNG", "WEBP", "TIFF"}  # several frames in one file (APNG, TIFF pages)


def _animation_of(path: Path, like: MediaInfo | None, fps) -> tuple | None:
    """(frame durations or None, loop count) of the animated file ``path`` is written as, or
    None when it gets one image per frame (the source is no animation, or JPEG)."""
    fmt = _WRITE_IMAGE_FORMATS[path.suffix.lower()]
    if like is None or like.kind != "animation" or fmt not in _ANIMATED_FORMATS:
        return None
    durations = like.frame_durations
    if fmt == "TIFF":
        return None, 0
    if durations is None and fps is None:
        raise MediaError(f"{path}: an animated {path.suffix[1:].upper()} needs a duration "
                         f"for each frame and the pages of {like.path} have none; give a "
                         f"frame rate, e.g. {option_ref('fps', 10)}, or write .tiff")
    if durations is None:
        durations = (1 / as_fraction(fps),) * like.frame_count
    return durations, like.loop or 0


def _warn_not_carried(path: Path, like: MediaInfo | None, spec: OutputSpec,
                      animation: tuple | None = None, folder: bool = False) -> None:
    """One warning naming every stream of ``like``'s source that the output of ``spec``
    leaves out (``folder``: the output is a folder of numbered PNGs)."""
    if like is None:
        return
    dropped = []
    video = not folder and path.suffix.lower() in VIDEO_EXTENSIONS  # else image files
    if like.kind == "animation" and not video:
        if animation is None:
            holder = "a folder holds" if folder else f"{path.suffix} holds one frame:"
            dropped.append(f"its animation ({holder} numbered frames without their timing; "
                           f"write .png, .webp or a video to keep it)")
        elif animation[0] is None and like.frame_durations is not None:
            dropped.append("its frame durations (TIFF pages have no timing; write .png, .webp "
                           "or a video to keep them)")
    if like.has_audio and not (video and spec.audio_from is not None):
        dropped.append("its audio" if video else
                       "its audio (images hold none; write a video to keep it)")
    for index, kind, codec in like.other_streams:
        if video and index in spec.subtitle_streams:
            continue
        if kind == "subtitle":
            holders = [e for e, codecs in _SUBTITLE_CODECS.items() if codec in codecs]
            where = f"; {' or '.join(holders)} holds it" if holders and video else ""
            dropped.append(f"subtitle stream #{index} ({codec}{where})")
        elif kind == "video":
            dropped.append(f"video stream #{index} ({codec}; only the first video stream is "
                           f"upscaled)")
        else:
            dropped.append(f"{kind} stream #{index} ({codec})")
    if dropped:
        warnings.warn(f"{path}: not carried over from {like.path}: {', '.join(dropped)}",
                      stacklevel=3)


class FrameOutput:
    """What every output of frames shares: ``write_many`` over ``write``, and context management:
    ``close()`` when the block ends normally, ``abort()`` (discard the output) when it raises."""

    def write_many(self, frames: Iterable[np.ndarray]) -> None:
        """Append frames from an iterable or a (N, H, W, C) array."""
        for frame in frames:
            self.write(frame)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class MediaWriter(FrameOutput):
    """Base class: frame checks, the temporary -> final protocol and context management."""

    def __init__(self, path: Path, spec: OutputSpec, *, overwrite: bool):
        self.path, self.spec, self.overwrite = path, spec, overwrite
        self.frames_written = 0
        self._state = "open"  # -> "closed" | "aborted" | "kept" (finished but not moved)
        self._temp: Path | None = None  # the partial file or folder we own

    def write(self, frame: np.ndarray) -> None:
        """Append one (H, W, C) frame."""
        if self._state != "open":
            raise MediaError(f"{self.path}: writer is already {self._state}")
        frame = self._checked(frame)
        try:
            self._write(frame)
        except MediaError:
            raise
        except Exception as e:  # name the file; the caller decides whether to abort
            raise MediaError(f"{self.path}: writing frame {self.frames_written} failed: {e}") from e
        self.frames_written += 1

    def _checked(self, frame) -> np.ndarray:
        """``frame`` as (H, W, C) (a 2-D array is one channel), or a MediaError: a wrong size
        or dtype is a pipeline bug, and saying so here is kinder than a garbled file."""
        where = f"{self.path} frame {self.frames_written}"
        if not isinstance(frame, np.ndarray):
            raise MediaError(f"{where}: frames must be numpy arrays, got {type(frame).__name__}")
        if frame.ndim == 2:
            frame = frame[:, :, None]
        spec = self.spec
        shape, dtype = (spec.height, spec.width, spec.channels), _FRAME_DTYPES[spec.bit_depth]
        if frame.shape != shape or frame.dtype != dtype:
            raise MediaError(f"{where}: expected a frame of shape {shape} {np.dtype(dtype).name}, "
                             f"got {frame.shape} {frame.dtype}")
        return frame

    def close(self) -> None:
        """Finish the output and move it to its final name; a no-op once closed. With no
        frames written this is an error and the partial output is removed."""
        if self._state == "closed":
            return
        if self._state != "open":
            raise MediaError(f"{self.path}: writer is already {self._state}")
        if self.frames_written == 0:
            self.abort()
            raise MediaError(f"{self.path}: no frames were written; nothing saved")
        try:
            self._finish()
        except FileExistsError:
            raise  # its message says where the finished output is kept
        except OSError as e:
            if self._state == "kept":  # complete, but the final move failed: keep it
                raise MediaError(f"{self.path}: could not move the finished output into "
                                 f"place ({e}); {self._what_is_kept()}") from e
            self.abort()
            raise MediaError(f"{self.path}: finishing the output failed: {e}") from e
        except BaseException:
            if self._state == "open":  # failed before the output was complete
                self.abort()
            raise
        finally:
            if self._state != "open":
                self._release_hold()
        self._state = "closed"

    def _what_is_kept(self) -> str:
        """Where the finished output waits, or why nothing does (its folder was deleted)."""
        if self._temp.exists():
            return f"it is kept at {self._temp}"
        if not self._temp.parent.is_dir():
            return f"nothing is kept: the folder {self._temp.parent} was removed while writing"
        return f"nothing is kept: {self._temp} was removed while writing"

    def abort(self) -> None:
        """Discard everything written so far. The final path is never touched."""
        if self._state in ("closed", "aborted", "kept"):
            return
        self._state = "aborted"
        try:
            self._release()
        finally:
            self._release_hold()
            if self._temp is not None:
                if self._temp.is_dir():
                    shutil.rmtree(self._temp, ignore_errors=True)
                else:
                    self._temp.unlink(missing_ok=True)

    def __del__(self):
        # Dropped without close(), the only way to a final file: discard the unfinished output.
        try:
            if getattr(self, "_state", None) == "open":
                self.abort()
        except Exception:  # noqa: BLE001 -- never raise from a finaliser
            pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {self._state}, " \
               f"{self.frames_written} frames)"

    def _write(self, frame: np.ndarray) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        """Complete the temporary output, set state "kept" (from now on a failure must not
        delete it), then move it into place."""
        raise NotImplementedError

    def _release(self) -> None:
        """Close open handles without finishing (abort)."""

    def _refuse_existing(self, target: Path) -> None:
        if (target.exists() or target.is_symlink()) and not self.overwrite:
            raise OutputExists(f"{target} already exists; pass {option_ref('overwrite', True)} "
                               f"to replace it, or choose another output name")

    def _claim_temp(self, folder: bool = False) -> None:
        """Create and hold the temporary the output is written to: a folder (image outputs,
        which check their final names themselves), else a file with the output's suffix
        (muxers want it), after refusing an existing output unless overwriting."""
        if not folder:
            self._refuse_existing(self.path)
        writable_folder(self.path.parent)
        remove_stale_temporaries(self.path)  # a killed run's: nothing else removes them
        temp = temporary_path(self.path, keep_suffix=not folder)
        try:
            if folder:
                os.mkdir(temp)
            else:  # umask permissions (tempfile.mkstemp would make the output owner-only)
                os.close(os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except OSError as e:
            raise MediaError(f"cannot write to output folder {self.path.parent}: "
                             f"{e.strerror or e}") from e
        self._temp = temp
        self._hold = hold(temp)  # in use: a later run must not take it for stale

    def _release_hold(self) -> None:
        if getattr(self, "_hold", None) is not None:
            self._hold.release()
            self._hold = None

    def _place(self, temp: Path, final: Path) -> None:
        """Move finished ``temp`` to ``final`` without ever clobbering unless overwriting."""
        if self.overwrite:
            os.replace(temp, final)
            return
        try:
            os.link(temp, final)  # atomic, and fails if ``final`` appeared meanwhile
        except FileExistsError:
            raise OutputExists(
                f"{final} appeared while writing and overwrite is off; the finished output is "
                f"kept at {temp} -- rename it yourself, or pass "
                f"{option_ref('overwrite', True)}") from None
        except OSError:  # no hard links on this filesystem (FAT, some network mounts)
            if final.exists():
                raise OutputExists(f"{final} appeared while writing and overwrite is off; "
                                   f"the finished output is kept at {temp}") from None
            os.rename(temp, final)
        else:
            os.unlink(temp)


class VideoWriter(MediaWriter):
    """H.264 / H.265 / VP9 through PyAV, with optional audio packet copy (:func:`open_writer`)."""

    def __init__(self, path: Path, spec: OutputSpec, *, overwrite: bool = False):
        import av

        super().__init__(path, spec, overwrite=overwrite)
        self._container = self._audio = self._last_pts = None
        self.fps, self._colour = as_fraction(spec.fps), spec.colour or Colour()
        key = self._choose_codec()
        self._claim_temp()
        try:
            times = spec.frame_times
            self._frame_times = tuple(Fraction(t) for t in times) if times else None
            self._frame_time_base = _time_base_for(self.fps, self._frame_times)
            self._stream = self._open_stream(key)
            # One swscale context for all frames (frame.reformat() would make one per frame).
            self._reformatter = av.video.reformatter.VideoReformatter()
            if spec.audio_from is not None:
                self._audio = _AudioCopy(fspath(spec.audio_from), self._container, path,
                                         spec.subtitle_streams)
            # Write the header now: encoder and muxer problems surface here, not at the end.
            try:
                self._container.start_encoding()
            except av.FFmpegError as e:
                copied = self._audio.describe() if self._audio is not None else ""
                if not copied:
                    raise
                raise MediaError(f"{path}: {path.suffix.lower()} files can't hold the streams "
                                 f"copied from {spec.audio_from} ({copied}): FFmpeg says "
                                 f"{e.strerror or e}; write .mkv, which holds most codecs") from e
        except BaseException as e:
            self.abort()
            if isinstance(e, (av.FFmpegError, OSError)):
                raise MediaError(f"{path}: cannot start writing video: {e}") from e
            raise

    def _choose_codec(self) -> str:
        """The codec key (h264/h265/vp9) and pixel format for this output, refusing what the
        codec or container can't do before anything is written."""
        path, ext, spec = self.path, self.path.suffix.lower(), self.spec
        codec, crf, preset = spec.codec, spec.crf, spec.preset
        key = _CODEC_ALIASES.get(str(codec).lower())
        if key is None:
            raise MediaError(f"{path}: unknown video codec {codec!r}; use 'h264', 'h265' or 'vp9'")
        if ext == ".webm":
            if key == "h265":
                raise MediaError(f"{path}: WebM holds VP8/VP9/AV1 video, not H.265; write "
                                 f".mkv or .mp4 for H.265, or leave the codec for WebM's VP9")
            key = "vp9"  # WebM's codec: the default H.264 can't go there
        _, _, self._pix_fmt, _, max_crf, _ = _VIDEO_CODECS[key]
        if spec.width % 2 or spec.height % 2:
            raise MediaError(
                f"{path}: {key.upper()} in yuv420 needs an even width and height, got "
                f"{spec.width}x{spec.height}; choose an even output size (or write PNGs)")
        if key == "h265" and spec.width < H265_MIN_WIDTH:
            raise MediaError(
                f"{path}: H.265 output must be at least {H265_MIN_WIDTH} px wide, got "
                f"{spec.width}x{spec.height} (libx265 corrupts memory and aborts on narrower "
                f"frames); use codec h264 or vp9, or a larger resolution")
        if crf is not None and not 0 <= crf <= max_crf:
            raise MediaError(f"{path}: crf must be between 0 and {max_crf} for "
                             f"{key.upper()}, got {crf}")
        if preset is not None and (key == "vp9" or preset not in _PRESETS):
            raise MediaError(f"{path}: unknown preset {preset!r} for {key.upper()}; "
                             + ("VP9 has none" if key == "vp9" else
                                f"use one of {', '.join(_PRESETS)}"))
        if self._colour.hdr and not self._pix_fmt.endswith("10le"):
            raise MediaError(f"{path}: the source is HDR video ({self._colour.hdr}), which needs "
                             f"10 bits, and {key.upper()} is written in 8 bits here; give codec "
                             f"h265 (10-bit) and a .mkv, .mp4 or .mov name")
        if spec.channels == 4 and key == "vp9" and ext in (".webm", ".mkv"):
            self._pix_fmt = "yuva420p"  # Matroska/WebM store VP9's alpha beside each frame
        elif spec.channels == 4:
            reason = "MP4 can't store VP9's alpha" if key == "vp9" else \
                f"{key.upper()} video has no alpha channel"
            warnings.warn(f"{path}: {reason}; alpha is dropped (write .webm, which keeps it as "
                          f"VP9, or a PNG sequence)", stacklevel=4)
        return key

    def _open_stream(self, key: str):
        """Open the container on the temporary and add the video stream, tagged with the
        source's colour description, orientation and pixel shape."""
        import av

        path, ext, spec = self.path, self.path.suffix.lower(), self.spec
        encoder, codec_name, _, default_crf, _, options = _VIDEO_CODECS[key]
        self._container = av.open(str(self._temp), "w", format=VIDEO_EXTENSIONS[ext])
        if codec_name not in self._container.supported_codecs:
            raise MediaError(f"{path}: {ext} files can't hold {key.upper()} video")
        if encoder not in av.codecs_available:
            raise MediaError(f"{path}: this FFmpeg build has no {encoder} encoder")
        stream = self._container.add_stream(encoder, rate=self.fps)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, self._pix_fmt
        # The encoder counts time in this base too: at 1/fps, variable-rate timestamps collide.
        stream.time_base = stream.codec_context.time_base = self._frame_time_base
        stream.options = {"crf": str(default_crf if spec.crf is None else spec.crf), **options,
                          **({} if spec.preset is None else {"preset": str(spec.preset)})}
        if key == "h265" and ext in (".mp4", ".mov", ".m4v"):
            stream.codec_tag = "hvc1"  # Apple players only accept HEVC tagged hvc1
        # The source's colour description (BT.709 limited range for sources without one):
        # _write converts with its matrix and range, so players agree.
        cc, colour, display = stream.codec_context, self._colour, spec.display
        cc.colorspace, cc.color_primaries = colour.matrix, colour.primaries
        cc.color_trc, cc.color_range = colour.transfer, colour.range
        # The source's orientation and pixel shape are tags players apply; frames stay as stored.
        if display is not None and (display.rotation or display.mirrored):
            stream.set_display_rotation(display.rotation, hflip=display.mirrored)
        if display is not None and display.pixel_aspect != 1:
            cc.sample_aspect_ratio = display.pixel_aspect
        return stream

    def _write(self, frame: np.ndarray) -> None:
        spec = self.spec
        if spec.channels == 4 and self._pix_fmt != "yuva420p":
            frame = frame[:, :, :3]
        picture = to_picture(frame)
        # Convert to YUV ourselves by the stream's tagged matrix and range (the encoder's own
        # conversion would use BT.601 limited range whatever the tags say); not by transfer or
        # primaries: the frames are already in the source's, and swscale would convert them.
        picture = self._reformatter.reformat(
            picture, format=self._pix_fmt, dst_colorspace=self._colour.conversion_matrix,
            dst_color_range=self._colour.range,
            threads=0 if spec.width * spec.height >= 640 * 480 else 1)
        pts = round(self._time_of(self.frames_written) / self._frame_time_base)
        if self._last_pts is not None and pts <= self._last_pts:
            pts = self._last_pts + 1  # timestamps must increase; rounding must not collide
        picture.pts = self._last_pts = pts
        # Constant rate: timestamps count frames (1/fps). The muxer may pick another stream
        # time base (MP4 uses 1/12800 for 25 fps), and PyAV rescales packets to it.
        picture.time_base = self._frame_time_base
        for packet in self._stream.encode(picture):
            self._container.mux(packet)
        if self._audio is not None:
            self._audio.mux_until(self._time_of(self.frames_written + 1))

    def _time_of(self, index: int) -> Fraction:
        """Presentation time of frame ``index`` in seconds: the source's own time for a
        variable-rate source, else ``index / fps``."""
        times = self._frame_times
        if not times:
            return Fraction(index) / self.fps
        if index < len(times):
            return times[index]
        return times[-1] + Fraction(index - len(times) + 1) / self.fps

    def _finish(self) -> None:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        if self._audio is not None:
            self._audio.mux_until(None)
            self._audio.close()
        self._container.close()
        self._state = "kept"
        self._place(self._temp, self.path)

    def _release(self) -> None:
        for thing in (self._audio, self._container):
            if thing is not None:
                try:
                    thing.close()
                except Exception:  # noqa: BLE001 -- aborting; the file is deleted anyway
                    pass


def _time_base_for(fps: Fraction, frame_times) -> Fraction:
    """1/fps for constant rate; for given frame times the coarsest time base that holds
    every one of them, and 1/fps, exactly (capped at microseconds, where rounding is
    inaudible). Encoders reject a base coarser than a nominal frame (libvpx)."""
    if not frame_times:
        return Fraction(1) / fps
    denominator = (1 / fps).denominator
    for t in frame_times:
        denominator = math.lcm(denominator, t.denominator)
        if denominator > 1_000_000:
            return Fraction(1, 1_000_000)
    return Fraction(1, denominator)


class _AudioCopy:
    """Copies every audio stream (and the subtitle streams asked for) of ``source`` into
    ``output`` packet for packet, interleaved with the video as frames are written
    (``mux_until``) and shifted by the source video's start time, keeping its sync."""

    def __init__(self, source: Path, output, dst: Path, subtitle_streams=()):
        import av

        if not source.is_file():
            raise MediaError(f"audio source {source}: no such file")
        try:
            self._input = av.open(str(source), metadata_errors="replace")
        except av.FFmpegError as e:
            raise MediaError(f"audio source {source}: cannot read: {e}") from e
        self._pending = None
        self._map = {}
        self._shift = {}
        try:
            streams = list(self._input.streams.audio) + \
                [self._input.streams[i] for i in subtitle_streams]
            video = next(iter(self._input.streams.video), None)
            start = (video.start_time or 0) * video.time_base if video is not None else 0
            ext = dst.suffix.lower()
            for s in streams:
                name = s.codec_context.name
                refused = _AUDIO_REFUSED.get(ext, {}).get(name)
                if name not in output.supported_codecs or refused:
                    raise MediaError(
                        f"{dst}: {ext} files can't hold the {_codec_title(name)} audio of "
                        f"{source}; write {refused or '.mkv'} instead (the audio is copied, "
                        f"not re-encoded)")
                out = output.add_stream_from_template(s)
                for key in ("language", "title", "handler_name"):
                    if key in s.metadata:
                        out.metadata[key] = s.metadata[key]
                self._map[s.index] = out
                self._shift[s.index] = round(start / s.time_base)
            self._packets = self._input.demux(streams) if streams else iter(())
            self._pull()
        except BaseException:
            self._input.close()
            raise
        self._output = output

    def _pull(self) -> None:
        # Empty packets are the demuxer's end-of-stream markers.
        self._pending = next((packet for packet in self._packets if packet.size), None)

    def mux_until(self, seconds: Fraction | None) -> None:
        """Mux audio packets up to ``seconds`` of output time (None: all that remain)."""
        while self._pending is not None:
            packet = self._pending
            index = packet.stream.index
            shift = self._shift[index]
            pts = packet.pts if packet.pts is not None else packet.dts
            if seconds is not None and pts is not None and \
                    (pts - shift) * packet.time_base > seconds:
                return
            shift_times(packet, -shift)
            packet.stream = self._map[index]
            self._output.mux(packet)
            self._pull()

    def describe(self) -> str:
        return ", ".join(f"{s.type} {s.codec_context.name}" for s in self._map.values())

    def close(self) -> None:
        self._input.close()


def shift_times(packet, ticks: int) -> None:
    """Move the timestamps ``packet`` has by ``ticks`` of its time base."""
    if packet.pts is not None:
        packet.pts += ticks
    if packet.dts is not None:
        packet.dts += ticks


def _codec_title(name: str) -> str:
    return {"opus": "Opus", "vorbis": "Vorbis", "aac": "AAC", "mp3": "MP3", "flac": "FLAC",
            "ac3": "AC-3", "eac3": "E-AC-3", "alac": "ALAC"}.get(name, name)


class _ImageFilesWriter(MediaWriter):
    """Shared by the image writers: frames go to a hidden partial folder first, numbered
    with at least five digits (more when ``expected_frames`` needs them)."""

    _fmt: str
    _ext: str

    def __init__(self, path: Path, spec: OutputSpec, *, overwrite: bool,
                 expected_frames: int | None):
        super().__init__(path, spec, overwrite=overwrite)
        self._display = spec.display if spec.upright else None
        self._digits = max(5, len(str((expected_frames or 1) - 1)))

    def _frame_file(self, index: int) -> Path:
        return self._temp / f"{index:0{self._digits}d}{self._ext}"

    def _write(self, frame: np.ndarray) -> None:
        from ._images import save_image

        if self._display is not None:
            frame = self._display.apply(frame)
        save_image(self._frame_file(self.frames_written), frame, self._fmt, self.spec.quality)


class ImageWriter(_ImageFilesWriter):
    """One image at ``path``, or ``stem_00000.ext``... next to it if several frames come; or,
    given ``animation`` (frame durations or None, loop count), one animated file of them all,
    encoded at close from frames waiting in the partial folder as PNGs."""

    def __init__(self, path: Path, spec: OutputSpec, *, overwrite: bool,
                 expected_frames: int | None, animation: tuple | None = None,
                 pattern: tuple[str, str, str] | None = None):
        if animation is not None:
            expected_frames = None  # one file: only ``path`` must be free
        super().__init__(path, spec, overwrite=overwrite, expected_frames=expected_frames)
        self._ext = path.suffix
        self._fmt = _WRITE_IMAGE_FORMATS[path.suffix.lower()]
        self._animation = animation
        self._pattern = pattern  # (prefix, %d spec, suffix): every frame numbered by it
        if animation is not None:
            self._ext, self._fmt = ".png", "PNG"  # the waiting frames
        if spec.channels == 4 and path.suffix.lower() in (".jpg", ".jpeg"):
            warnings.warn(f"{path}: JPEG has no alpha channel; alpha is dropped (use .png or "
                          f".webp to keep it)", stacklevel=3)
        final_fmt = _WRITE_IMAGE_FORMATS[path.suffix.lower()]
        if spec.bit_depth == 16 and (final_fmt in ("JPEG", "WEBP") or animation is not None):
            what = "an animation" if animation is not None else final_fmt
            warnings.warn(f"{path}: {what} is 8-bit here; 16-bit frames are rounded to 8 bits "
                          f"(use single .png or .tiff files to keep 16 bits)", stacklevel=3)
        if pattern is not None or expected_frames is not None and expected_frames > 1:
            # Every name, now: finding o_00003.png taken only at the end would waste the run.
            for index in range(expected_frames or 1):
                self._refuse_existing(self._numbered(index))
        else:
            self._refuse_existing(path)
        self._claim_temp(folder=True)

    def _numbered(self, index: int) -> Path:
        if self._pattern is not None:
            prefix, spec, suffix = self._pattern
            return self.path.with_name(f"{prefix}{spec % index}{suffix}")
        return self.path.with_name(f"{self.path.stem}_{index:0{self._digits}d}{self._ext}")

    def _finish(self) -> None:
        if self._animation is not None:
            self._finish_animation()
            return
        self._state = "kept"
        if self.frames_written == 1 and self._pattern is None:
            self._place(self._frame_file(0), self.path)
        else:
            targets = [self._numbered(i) for i in range(self.frames_written)]
            if not self.overwrite:
                taken = [t for t in targets if t.exists()]
                if taken:
                    raise OutputExists(
                        f"{taken[0]} already exists; the finished frames are kept in {self._temp} "
                        f"-- pass {option_ref('overwrite', True)} or choose another name")
            for i, target in enumerate(targets):
                self._place(self._frame_file(i), target)
        self._temp.rmdir()

    def _waiting_frames(self):
        from .reader import open_media

        for index in range(self.frames_written):
            with open_media(self._frame_file(index)) as image:
                yield from image.frames()

    def _finish_animation(self) -> None:
        """Encode the waiting PNGs into the final file: animated, or a still of one frame."""
        from ._images import save_animation, save_image

        final_fmt = _WRITE_IMAGE_FORMATS[self.path.suffix.lower()]
        encoded = self._temp / f"animation{self.path.suffix}"
        durations, loop = self._animation
        if self.frames_written == 1:
            save_image(encoded, next(self._waiting_frames()), final_fmt, self.spec.quality)
        else:
            if durations is not None:  # as many as frames were written
                durations = (tuple(durations) + durations[-1:] * self.frames_written)[
                    :self.frames_written]
            save_animation(encoded, self._waiting_frames(), final_fmt, durations, loop,
                           self.spec.quality)
        self._state = "kept"
        self._place(encoded, self.path)
        for index in range(self.frames_written):
            self._frame_file(index).unlink()
        self._temp.rmdir()


class SequenceWriter(_ImageFilesWriter):
    """Numbered PNGs (``00000.png``...) in the folder ``path``, written to a hidden sibling folder
    renamed into place at close; replacing a folder that holds files needs ``overwrite=True``."""

    _fmt, _ext = "PNG", ".png"

    def __init__(self, path: Path, spec: OutputSpec, *, overwrite: bool,
                 expected_frames: int | None):
        super().__init__(path, spec, overwrite=overwrite, expected_frames=expected_frames)
        if path.exists() and not path.is_dir():
            raise MediaError(f"{path} exists and is not a folder; a frame sequence needs one")
        if path.is_dir() and any(path.iterdir()) and not self.overwrite:
            raise OutputExists(f"{path} already exists and is not empty; pass "
                               f"{option_ref('overwrite', True)} to replace its frames, or "
                               f"choose another output folder")
        self._claim_temp(folder=True)

    def _finish(self) -> None:
        self._state = "kept"
        if self.path.is_dir() and not any(self.path.iterdir()):
            self.path.rmdir()
        try:
            if not self.path.exists():
                os.rename(self._temp, self.path)
                return
        except OSError:  # the folder appeared (and filled) meanwhile
            pass
        if not self.overwrite:
            raise OutputExists(f"{self.path} appeared while writing; the finished frames "
                               f"are kept in {self._temp}")
        new = {f.name for f in self._temp.iterdir()}
        for name in sorted(new):
            os.replace(self._temp / name, self.path / name)
        for old in self.path.iterdir():
            if re.fullmatch(r"\d+\.png", old.name) and old.name not in new:
                old.unlink()
        self._temp.rmdir()
