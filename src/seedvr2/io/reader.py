"""Readers: a video, an image (one frame, or an animation's every frame) or a numbered image
sequence, all as a stream of (H, W, C) frames in presentation order: docs/media.md#reading."""

from __future__ import annotations

import itertools
import math
import os
import re
import warnings
import weakref
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np

from ..errors import InputError
from ._common import (ARRAY_FORMATS, IMAGE_EXTENSIONS, PRINTF, Colour, MediaError, MediaInfo,
                      fspath, printf_pattern, sniff_image, with_channels)
from ._images import ImageProbe, animation_frames, load_image, probe_image, scan_animation

# Packets are counted up front (exact, but the whole file is read) only in files this small.
_COUNT_PACKETS_MAX_BYTES = 256 * 2**20
_MAX_DECODE_FAILURES = 100  # damaged packets skipped in one pass before decoding gives up
_KEYFRAME_SEARCH_LIMIT = 1000  # frames decoded after a seek in search of a keyframe
# Decoded timestamps of recent variable-rate videos, by (path, size, mtime, stream, decoder).
_DECODED_STAMPS: dict[tuple, list] = {}
_DECODED_STAMPS_KEPT = 8  # videos, of a few integers per frame


def is_sequence_pattern(path) -> bool:
    """True for a path :func:`open_media` reads as a sequence pattern (``f/%05d.png``,
    ``f/*.png``): it does not exist and its name holds a printf number or glob characters."""
    p = fspath(path)
    return not p.exists() and (bool(PRINTF.search(p.name)) or any(ch in p.name for ch in "*?["))


def open_media(path) -> MediaReader:
    """Open a video, an image, a folder of numbered images or a pattern like ``f/%05d.png``,
    telling them apart by content (docs/media.md#reading). Raises :class:`MediaError` naming
    the path when it is missing, unreadable, empty, or not something we can decode."""
    p = fspath(path)
    if p.is_dir():
        return SequenceReader.from_directory(p)
    if is_sequence_pattern(p):  # an existing file named "100%done.png" is a file
        return (SequenceReader.from_pattern if PRINTF.search(p.name) else
                SequenceReader.from_glob)(p)
    if not p.exists():
        raise MediaError(f"{p}: no such file or directory")
    if not p.is_file():
        raise MediaError(f"{p}: not a regular file")
    if p.stat().st_size == 0:
        raise MediaError(f"{p}: file is empty")
    fmt = sniff_image(p)
    if fmt is not None:
        probe = probe_image(p, fmt)
        return AnimationReader(p, probe) if probe.frames > 1 else ImageReader(p, fmt, probe)
    if p.suffix.lower() not in IMAGE_EXTENSIONS:
        return VideoReader(p)
    # Named like an image without an image's signature: a text file or a failed download, most
    # likely. A video so named still opens; FFmpeg's complaints are noise beside "not an image".
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            reader = VideoReader(p)
        except MediaError:
            reader = None
    if reader is None:
        raise MediaError(f"{p}: not an image -- the file does not start like a PNG, JPEG, "
                         f"WebP, TIFF or BMP file (is it a text or HTML file, or a failed "
                         f"download?), and FFmpeg cannot read it as a video either")
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename,
                               warning.lineno)
    return reader


class MediaReader:
    """Base class: ``info``, ``frames()``, iteration and context management."""

    info: MediaInfo

    def frames(self, start: int = 0, stop: int | None = None) -> Iterator[np.ndarray]:
        """Frames ``start`` .. ``stop - 1`` (``stop=None``: to the end) as (H, W, C) arrays."""
        if start < 0 or (stop is not None and stop < 0):
            raise InputError(f"frame indices must be >= 0, got start={start}, stop={stop}")
        return self._frames(start, stop)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self.frames()

    def close(self) -> None:
        """Release files and decoders. Iterators still running are closed too."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.info!r})"


class ImageReader(MediaReader):
    """One still image, decoded once at open (so a corrupt file fails before any work); files
    of several frames are :class:`AnimationReader`'s (animated GIFs open as videos)."""

    def __init__(self, path: Path, fmt: str, probe: ImageProbe | None = None):
        self.path = path
        probe = probe or probe_image(path, fmt)
        self._image: np.ndarray | None = load_image(path, probe)
        height, width = self._image.shape[:2]
        self.info = MediaInfo(kind="image", path=str(path), frame_count=1, width=width,
                              height=height, channels=probe.channels,
                              bit_depth=probe.bit_depth, codec=fmt.lower())

    def _frames(self, start: int, stop: int | None) -> Iterator[np.ndarray]:
        if self._image is None:
            raise MediaError(f"{self.path}: reader is closed")
        if start == 0 and (stop is None or stop > 0):
            return iter([self._image.copy()])  # callers may modify frames in place
        return iter([])

    def close(self) -> None:
        self._image = None


class AnimationReader(MediaReader):
    """Every frame of one animated WebP or PNG, or every page of a multi-page TIFF: decoded once at
    open, then again one at a time as read (never held whole). ``info.kind`` is ``"animation"``."""

    def __init__(self, path: Path, probe: ImageProbe):
        self.path = path
        self._probe = probe
        scan = scan_animation(path, probe)
        fps, times = _animation_timing(scan.durations)
        self.info = MediaInfo(kind="animation", path=str(path), frame_count=probe.frames,
                              width=scan.width, height=scan.height, channels=scan.channels,
                              bit_depth=8, fps=fps, codec=probe.fmt.lower(), frame_times=times,
                              frame_durations=scan.durations, loop=scan.loop)
        self._iterators: weakref.WeakSet | None = weakref.WeakSet()

    def _frames(self, start: int, stop: int | None) -> Iterator[np.ndarray]:
        if self._iterators is None:
            raise MediaError(f"{self.path}: reader is closed")
        iterator = animation_frames(self.path, self._probe, self.info.channels, start, stop)
        self._iterators.add(iterator)
        return iterator

    def close(self) -> None:
        for iterator in list(self._iterators or ()):
            iterator.close()  # closes its file
        self._iterators = None


def _animation_timing(durations) -> tuple[Fraction | None, tuple[Fraction, ...] | None]:
    """(fps, frame_times) of an animation whose frames show for ``durations`` seconds: the
    rate of its most common duration, and every frame's start time when they differ (so a
    video output shows each frame as long as the animation does). No timing, or only
    zero durations: no rate (a video output then needs one given)."""
    shown = [d for d in durations or () if d > 0]
    if not shown:
        return None, None
    nominal = max(set(shown), key=shown.count)
    if all(d == nominal for d in durations):
        return 1 / nominal, None
    return 1 / nominal, tuple(itertools.accumulate(durations[:-1], initial=Fraction(0)))


class SequenceReader(MediaReader):
    """Numbered images read in numeric order (``9.png`` before ``10.png``; gaps allowed),
    every file's header checked at open."""

    def __init__(self, source: Path, files: list[Path]):
        if not files:
            raise MediaError(f"{source}: no images found")
        self.path = source
        self.files = files
        first = files[0]
        self._probe = _sequence_probe(first)
        self._fmt = self._probe.fmt
        for f in files[1:]:
            probe = _sequence_probe(f)
            if _describe(probe) != _describe(self._probe):
                raise MediaError(
                    f"{f}: {_describe(probe)} differs from the first frame {first.name} "
                    f"({_describe(self._probe)}); all images of a sequence must have the same "
                    f"size, channels and bit depth")
        self.info = MediaInfo(kind="sequence", path=str(source), frame_count=len(files),
                              width=self._probe.width, height=self._probe.height,
                              channels=self._probe.channels, bit_depth=self._probe.bit_depth,
                              codec=self._fmt.lower())

    @classmethod
    def from_directory(cls, folder: Path) -> SequenceReader:
        """Images in ``folder`` sharing one name pattern, by the last number in a name (hidden and
        non-image files ignored); several patterns (``a_001.png``, ``b_001.png``) are refused."""
        try:
            names = [f for f in folder.iterdir() if not f.name.startswith(".")
                     and f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file()]
        except OSError as e:
            raise MediaError(f"{folder}: cannot list folder: {e.strerror or e}") from e
        if not names:
            raise MediaError(f"{folder}: no images found in this folder "
                             f"(looked for {', '.join(sorted(IMAGE_EXTENSIONS))})")
        groups: dict[tuple[str, str], list[tuple[int, Path]]] = {}
        unnumbered = []
        for f in names:
            m = re.fullmatch(r"(.*?)(\d+)(\D*)", f.name)
            if m is None:
                unnumbered.append(f.name)
                continue
            groups.setdefault((m[1], m[3]), []).append((int(m[2]), f))
        if len(groups) != 1 or unnumbered:
            kinds = [f"{pre}#{suf}" for pre, suf in sorted(groups)] + sorted(unnumbered)[:3]
            if not groups:
                raise MediaError(f"{folder}: no numbered images (found {', '.join(kinds)})")
            raise MediaError(
                f"{folder}: images follow several naming patterns ({', '.join(kinds[:6])}); "
                f"pass a pattern such as {folder / '<prefix>%05d.png'} to choose one")
        return cls(folder, _sorted_unique(folder, next(iter(groups.values()))))

    @classmethod
    def from_pattern(cls, pattern: Path) -> SequenceReader:
        """Files matching a printf pattern like ``frames/%05d.png`` (exactly as printf writes
        them, so ``%05d`` matches ``00042`` and ``123456`` but not ``42``)."""
        folder = pattern.parent
        prefix, spec, suffix = printf_pattern(pattern)
        if not folder.is_dir():
            raise MediaError(f"{pattern}: folder {folder} does not exist")
        found = []
        for f in folder.iterdir():
            if f.name.startswith(prefix) and f.name.endswith(suffix) and \
                    len(f.name) > len(prefix) + len(suffix):
                digits = f.name[len(prefix):len(f.name) - len(suffix)]
                if digits.isascii() and digits.isdigit() and spec % int(digits) == digits:
                    found.append((int(digits), f))
        if not found:
            raise MediaError(f"{pattern}: no files match this pattern")
        return cls(pattern, _sorted_unique(pattern, found))

    @classmethod
    def from_glob(cls, pattern: Path) -> SequenceReader:
        """Files matching a glob like ``frames/*.png``, ordered by the last number in the
        name (then by name, for names without numbers)."""
        if not pattern.parent.is_dir():
            raise MediaError(f"{pattern}: folder {pattern.parent} does not exist")
        try:
            files = [f for f in pattern.parent.glob(pattern.name) if f.is_file()]
        except ValueError as e:  # pathlib's own refusals: "'**' can only be an entire ..."
            raise MediaError(f"{pattern}: not a usable file name pattern ({e})") from None
        if not files:
            raise MediaError(f"{pattern}: no files match this pattern")

        def key(f: Path):
            numbers = re.findall(r"\d+", f.name)
            return (int(numbers[-1]) if numbers else -1, f.name)

        return cls(pattern, sorted(files, key=key))

    def _frames(self, start: int, stop: int | None) -> Iterator[np.ndarray]:
        for f in self.files[start:stop]:
            fmt = _sniff_sequence_file(f)
            probe = self._probe if fmt == self._fmt else probe_image(f, fmt)
            frame = load_image(f, probe)
            if frame.shape != (self.info.height, self.info.width, self.info.channels):
                # Headers were checked at open; this catches files replaced since then.
                raise MediaError(f"{f}: decoded to shape {frame.shape}, expected "
                                 f"{(self.info.height, self.info.width, self.info.channels)}")
            yield frame


def _sequence_probe(f: Path) -> ImageProbe:
    """The header of one sequence image, refusing a file with several frames."""
    probe = probe_image(f, _sniff_sequence_file(f))
    if probe.frames > 1:
        raise MediaError(f"{f}: holds {probe.frames} frames (an animated or multi-page "
                         f"image); the images of a sequence must have one frame each -- "
                         f"upscale this file on its own")
    return probe


def _sniff_sequence_file(f: Path) -> str:
    fmt = sniff_image(f)
    if fmt is None:
        raise MediaError(f"{f}: not a PNG, JPEG, WebP, TIFF or BMP image (empty or corrupt?)")
    return fmt


def _sorted_unique(source: Path, numbered: list[tuple[int, Path]]) -> list[Path]:
    numbered.sort(key=lambda item: item[0])
    for (a, fa), (b, fb) in zip(numbered, numbered[1:]):
        if a == b:
            raise MediaError(f"{source}: {fa.name} and {fb.name} have the same frame number")
    return [f for _, f in numbered]


def _describe(probe: ImageProbe) -> str:
    """Size, channels and bit depth: what every image of a sequence must share."""
    kind = {1: "gray", 3: "RGB", 4: "RGBA"}[probe.channels]
    return f"{probe.width}x{probe.height} {kind} {probe.bit_depth}-bit"


class VideoReader(MediaReader):
    """A video file through FFmpeg (PyAV): the first video stream that is not cover art,
    decoded at open up to its first frame. ``frames(start)`` seeks by timestamp only where
    that gives the same frames as decoding from the start (docs/media.md#reading)."""

    def __init__(self, path: Path):
        import av

        self.path = path
        self._iterators: weakref.WeakSet = weakref.WeakSet()
        self._pts_index: dict[int, int] | None = None
        try:
            container = av.open(str(path), metadata_errors="replace")
        except av.FFmpegError as e:
            raise MediaError(f"{path}: not a video or image that FFmpeg or Pillow can read "
                             f"({_ffmpeg_message(e)}); is it corrupt or truncated?") from e
        try:
            self._stream_index = _pick_video_stream(path, container)
            stream = container.streams[self._stream_index]
            self._decoder = _alpha_decoder(path, stream)
            fps = _frame_rate(stream)
            if fps is None:
                raise MediaError(f"{path}: the video's frame rate is unknown")
            first = next(self._decode(container), None)
            if first is None:
                raise MediaError(f"{path}: video stream has zero frames")
            channels, bit_depth = _pixel_layout(first.format)
            self._array_format = ARRAY_FORMATS[channels, bit_depth]
            self._time_base = stream.time_base
            self._first_pts = first.pts if first.pts is not None else 0
            self._src_colour = _source_colour_kwargs(first)
            rotation, mirrored = _orientation(path, first)
            frame_count, exact = _estimate_frame_count(stream, container, fps)
            self._video_seconds = _video_duration(stream, container)
            self.info = MediaInfo(
                kind="video", path=str(path), frame_count=frame_count, width=first.width,
                height=first.height, channels=channels, bit_depth=bit_depth, fps=fps,
                has_audio=bool(container.streams.audio), frame_count_exact=exact,
                codec=stream.codec_context.name, rotation=rotation, mirrored=mirrored,
                pixel_aspect=_pixel_aspect(stream),
                other_streams=_other_streams(container, self._stream_index),
                colour=_colour(first))
            base = stream.base_rate
            self._base_rate = Fraction(base) if base else None
            self._constant_rate = first.pts is not None and _rates_agree(stream)  # pts -> index
        finally:
            container.close()
        if not self._constant_rate or not self._count_matches_duration() or \
                (not exact and path.stat().st_size <= _COUNT_PACKETS_MAX_BYTES):
            # Variable rate: the stored count and rate x duration both go wrong (an MP4 edit list
            # can hide a frame that still has a packet), and the audio's sync needs every frame's
            # time; only decoding tells both. A stored count that disagrees with the duration (an
            # edit list trimming a constant-rate video, or dropped frames) is checked likewise.
            self.count_frames()  # also decides seekability
        else:
            self._update_seekable()

    def _count_matches_duration(self) -> bool:
        """The frame count agrees with duration x fps to half a frame (or either is unknown)."""
        if not self.info.frame_count_exact or self._video_seconds is None:
            return True
        expected = self._video_seconds * self.info.fps
        return abs(self.info.frame_count - expected) <= Fraction(1, 2)

    def _update_seekable(self) -> None:
        """Seek on the constant-rate grid only if the count agrees with duration x fps (a
        shortfall means dropped frames: timestamps and frame indices part ways), or where every
        frame's timestamp is known from decoding, which names its frame exactly."""
        consistent = self._count_matches_duration()
        self._seekable = (self._constant_rate and consistent) or self._pts_index is not None

    def count_frames(self) -> int:
        """Make ``info.frame_count`` exact (and fill ``info.frame_times`` of variable-rate video) by
        counting packets where exact, else decoding (docs/media.md#reading); returns the count."""
        import dataclasses

        import av

        try:
            stamps = None
            if self._constant_rate:
                stamps = self._packet_stamps()
                if self._times_of(stamps, self.info.fps) is not None:
                    stamps = None  # off the grid: variable rate after all
            if stamps is None:
                stamps = self._decoded_stamps()
        except av.FFmpegError as e:
            raise MediaError(f"{self.path}: cannot read video: {_ffmpeg_message(e)}") from e
        if not stamps:
            raise MediaError(f"{self.path}: video stream has zero frames")
        fps = self.info.fps
        if self._base_rate and self._base_rate != fps and \
                self._times_of(stamps, self._base_rate) is None:
            # The average rate counts the last frame's duration, which muxers guess; every
            # frame on FFmpeg's base-rate grid means a constant rate of that.
            fps, self._constant_rate = self._base_rate, True
        self.info = dataclasses.replace(self.info, frame_count=len(stamps),
                                        frame_count_exact=True, fps=fps,
                                        frame_times=self._times_of(stamps, fps))
        self._update_seekable()
        return len(stamps)

    def _decoded_stamps(self) -> list[int | None]:
        """Every decoded frame's timestamp. Remembered for the same unchanged file: a job
        opens its input once to check it before the models load and again for the work."""
        stat = self.path.stat()
        key = (str(self.path.resolve()), stat.st_size, stat.st_mtime_ns, self._stream_index,
               self._decoder)
        stamps = _DECODED_STAMPS.get(key)
        if stamps is None:
            container = self._open()
            try:
                stamps = [frame.pts for frame in self._decode(container)]
            finally:
                container.close()
            while len(_DECODED_STAMPS) >= _DECODED_STAMPS_KEPT:
                _DECODED_STAMPS.pop(next(iter(_DECODED_STAMPS)))
            _DECODED_STAMPS[key] = stamps
        return list(stamps)

    def _packet_stamps(self) -> list[int | None]:
        """Presentation timestamps of the packets that make shown frames, in display order."""
        import av

        stamps = []
        with av.open(str(self.path), metadata_errors="replace") as container:
            for packet in container.demux(container.streams[self._stream_index]):
                if packet.size and not packet.is_discard:
                    stamps.append(packet.pts)
        if any(pts is None for pts in stamps):
            return stamps  # unordered: _times_of spaces them by the nominal rate
        return sorted(stamps)

    def _times_of(self, stamps: list[int | None], fps: Fraction) -> tuple[Fraction, ...] | None:
        """Seconds from the first frame for each decoded frame, or None when they are the
        constant-rate grid ``i / fps`` anyway (to within one timestamp tick)."""
        tick = self._time_base
        times: list[Fraction] = []
        self._pts_index = {}  # pts -> frame index, for seeking in variable-rate video
        for i, pts in enumerate(stamps):
            time = None if pts is None else (pts - self._first_pts) * tick
            if time is None or (times and time <= times[-1]):
                # A missing or non-increasing timestamp (broken muxing): show the frame one
                # nominal interval after the previous one rather than fail or reorder.
                time = times[-1] + 1 / fps if times else Fraction(0)
                self._pts_index = None  # timestamps don't name frames: never seek by them
            elif self._pts_index is not None:
                self._pts_index[pts] = i
            times.append(time)
        if all(abs(t - Fraction(i) / fps) <= tick for i, t in enumerate(times)):
            self._pts_index = None
            return None
        return tuple(times)

    def _frames(self, start: int, stop: int | None) -> Iterator[np.ndarray]:
        iterator = self._iterate(start, stop)
        self._iterators.add(iterator)
        return iterator

    def close(self) -> None:
        for iterator in list(self._iterators):
            iterator.close()  # runs its finally: closes its container
        self._iterators.clear()

    def _iterate(self, start: int, stop: int | None) -> Iterator[np.ndarray]:
        import av

        container = None
        try:
            if stop is not None and stop <= start:
                return
            container = self._open()
            decoded = None
            if start > 0 and self._seekable:
                decoded = self._seek(container, start)
                if decoded is None:  # timestamps didn't line up: decode from the start instead
                    container.close()
                    container = self._open()
            if decoded is None:
                decoded = itertools.islice(self._decode(container), start, None)
            convert = self._converter()
            index = start
            for frame in decoded:
                if stop is not None and index >= stop:
                    break
                yield convert(frame, index)
                index += 1
            else:  # (an estimated count may be off by a frame or so: said only of a stored one)
                if self.info.frame_count_exact and index < min(self.info.frame_count,
                                                               stop or self.info.frame_count):
                    warnings.warn(f"{self.path}: the container declares "
                                  f"{self.info.frame_count} frames, decoding gave {index}: the "
                                  f"file is truncated or damaged, and only those are read",
                                  stacklevel=2)
        except av.FFmpegError as e:
            raise MediaError(f"{self.path}: cannot read video: {_ffmpeg_message(e)}") from e
        finally:
            if container is not None:
                container.close()

    def _open(self):
        import av

        container = av.open(str(self.path), metadata_errors="replace")
        # Frame + slice threads decode several times faster; settable only before the first packet.
        container.streams[self._stream_index].thread_type = "AUTO"
        return container

    def _decode(self, container) -> Iterator:
        import av

        stream = container.streams[self._stream_index]
        decoder = stream
        if self._decoder is not None:
            decoder = av.CodecContext.create(self._decoder, "r")
            decoder.thread_type = "AUTO"
        failures = 0
        try:
            for packet in container.demux(stream):  # ends with an empty packet: flush
                try:
                    frames = decoder.decode(packet if packet.size else None)
                except av.InvalidDataError as e:
                    # Like ffmpeg, skip a damaged packet: the decoder resyncs at the next keyframe.
                    failures += 1
                    if failures == 1:
                        at = "" if packet.pts is None else \
                            f" near {float(packet.pts * stream.time_base):.2f}s"
                        warnings.warn(f"{self.path}: skipping undecodable video data{at} "
                                      f"({_ffmpeg_message(e)})", stacklevel=2)
                    if failures > _MAX_DECODE_FAILURES:
                        raise
                    continue
                yield from frames
        except av.FFmpegError as e:
            raise MediaError(f"{self.path}: decoding failed: {_ffmpeg_message(e)}") from e

    def _index_of(self, pts: int | None) -> int | None:
        """The frame index timestamp ``pts`` stands for, or None if it is off the 1/fps grid
        by more than one timestamp tick (so the video isn't constant-rate here)."""
        if pts is None:
            return None
        if self._pts_index is not None:
            return self._pts_index.get(pts)
        position = (pts - self._first_pts) * self._time_base * self.info.fps
        index = round(position)
        tick = self._time_base * self.info.fps  # one timestamp unit, in frames
        return index if abs(position - index) <= tick else None

    def _seek(self, container, start: int) -> Iterator | None:
        """Decoded frames from frame ``start`` on, or None if that can't be done exactly."""
        import av

        stream = container.streams[self._stream_index]
        times = self.info.frame_times
        if times is not None and start >= len(times):
            return iter(())
        target = self._first_pts + (times[start] if times is not None else
                                    Fraction(start) / self.info.fps) / self._time_base
        back = Fraction(0)  # seconds before the target; grows when a seek lands too late
        for _ in range(4):
            offset = math.floor(target - back / self._time_base)
            if offset <= self._first_pts:
                return None  # the start is near the beginning: plain decoding is as fast
            try:
                container.seek(offset, stream=stream, backward=True, any_frame=False)
            except av.FFmpegError:
                return None  # unseekable input (pipe-like formats): decode from the start
            decoded = self._decode(container)
            # Open-GOP leading pictures before a seek's first keyframe may reference skipped data.
            frame = None
            for frame in itertools.islice(decoded, _KEYFRAME_SEARCH_LIMIT):
                if frame.key_frame:
                    break
            else:
                past_end = self.info.frame_count_exact and start >= self.info.frame_count
                return iter(()) if frame is None and past_end else None
            index = self._index_of(frame.pts)
            if index is None:
                return None
            if index > start:
                back = max(Fraction(1), 2 * back)
                continue
            while index < start:
                frame = next(decoded, None)
                if frame is None:
                    return iter(())  # the video ends before ``start``
                index += 1
                if self._index_of(frame.pts) != index:
                    return None
            return itertools.chain([frame], decoded)
        return None

    def _converter(self):
        """A function decoded frame -> (H, W, C) array, with one swscale context for the whole
        iteration: PyAV's ``to_ndarray(format=...)`` builds a new one, and a new thread pool,
        for every frame, which costs more than the conversion itself on small frames."""
        from av.video.reformatter import VideoReformatter

        reformatter = VideoReformatter()
        kwargs = dict(self._src_colour, format=self._array_format,
                      threads=0 if self.info.width * self.info.height >= 640 * 480 else 1)

        def convert(frame, index: int) -> np.ndarray:
            try:
                array = reformatter.reformat(frame, **kwargs).to_ndarray()
            except Exception as e:  # noqa: BLE001 -- name the frame whatever went wrong
                raise MediaError(f"{self.path}: cannot convert frame {index}: {e}") from e
            return with_channels(array)

        return convert


def _pick_video_stream(path: Path, container) -> int:
    from av.stream import Disposition

    videos = [s for s in container.streams.video if not s.disposition & Disposition.attached_pic]
    for stream in videos[:1]:
        if stream.codec_context is None:  # (PyAV gives a stream without a decoder none)
            raise MediaError(f"{path}: its video stream cannot be decoded: FFmpeg has no "
                             f"decoder for it, or the file is damaged or truncated")
        if len(videos) > 1:
            warnings.warn(f"{path}: has {len(videos)} video streams; reading stream "
                          f"#{stream.index} ({stream.width}x{stream.height}), the first that "
                          f"is not a cover picture; the others are left out (ffmpeg -map 0:v:N "
                          f"-c copy makes a file of the one you want)",
                          stacklevel=3)
        return stream.index
    what = "audio only" if container.streams.audio else "no streams FFmpeg can use"
    raise MediaError(f"{path}: has no video stream ({what})")


# FFmpeg's own VP8/VP9 decoders ignore the alpha plane WebM stores by each frame; libvpx's read it.
_ALPHA_DECODERS = {"vp8": "libvpx", "vp9": "libvpx-vp9"}


def _alpha_decoder(path: Path, stream) -> str | None:
    """The decoder to use instead of FFmpeg's default, when the default would drop alpha."""
    import av

    codec = stream.codec_context.name
    if codec not in _ALPHA_DECODERS or stream.metadata.get("alpha_mode") != "1":
        return None
    if _ALPHA_DECODERS[codec] in av.codecs_available:
        return _ALPHA_DECODERS[codec]
    warnings.warn(f"{path}: this {codec.upper()} video has an alpha channel, but this FFmpeg "
                  f"build lacks the {_ALPHA_DECODERS[codec]} decoder that reads it; the "
                  f"transparency is lost (install a PyAV/FFmpeg build with libvpx)",
                  stacklevel=4)
    return None


def _other_streams(container, video_index: int) -> tuple[tuple[int, str, str], ...]:
    """(index, type, codec) of every stream that is neither the video read nor audio."""
    others = []
    for stream in container.streams:
        if stream.index == video_index or stream.type == "audio":
            continue
        context = getattr(stream, "codec_context", None)
        codec = getattr(context, "name", None) if context is not None else None
        # Data streams (timecode, camera metadata) have no codec; their handler says what they are.
        codec = codec or stream.metadata.get("handler_name") or "unknown codec"
        others.append((stream.index, stream.type, codec))
    return tuple(others)


def _orientation(path: Path, frame) -> tuple[int, bool]:
    """(rotation in degrees counter-clockwise, mirrored) from the frame's display matrix. The
    rotation angle alone misreads a flip: FFmpeg reports a left-right mirror as a 180-degree turn.
    So the matrix is matched against the eight quarter-turn-and-mirror matrices FFmpeg writes
    (``av_display_rotation_set``, then ``av_display_matrix_flip`` negating the first column), the
    same reading the ffmpeg tool's autorotation makes."""
    import struct

    from av.sidedata.sidedata import Type

    data = frame.side_data.get(Type.DISPLAYMATRIX)  # on every decoded frame since FFmpeg 7
    if data is None or len(bytes(data)) < 36:
        return 0, False
    a, b, _, c, d, *_ = struct.unpack("<9i", bytes(data)[:36])
    unit = 1 << 16  # 16.16 fixed point
    for turns in range(4):
        cos, sin = ((1, 0), (0, 1), (-1, 0), (0, -1))[turns]
        for mirrored in (False, True):
            sign = -1 if mirrored else 1
            if (a, b, c, d) == (sign * cos * unit, -sin * unit, sign * sin * unit, cos * unit):
                return (turns * 90 + 180) % 360 - 180, mirrored
    warnings.warn(f"{path}: the video's display matrix is not a quarter turn (rotation "
                  f"{frame.rotation:.1f} degrees); image outputs show its frames as stored",
                  stacklevel=3)
    return 0, False


def _pixel_aspect(stream) -> Fraction:
    """Width : height of one stored pixel (1 when the video does not say)."""
    ratio = stream.sample_aspect_ratio or stream.codec_context.sample_aspect_ratio
    return Fraction(ratio) if ratio and ratio > 0 else Fraction(1)


def _frame_rate(stream) -> Fraction | None:
    """The stream's frame rate as an exact fraction. The average rate is the honest one; FFmpeg's
    r_frame_rate (base_rate) is usually the same number as a cleaner fraction (30000/1001 rather
    than 1798200/60001 from rounded MKV timestamps), so prefer it when the two agree."""
    if _rates_agree(stream):
        return Fraction(stream.base_rate)
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return Fraction(rate) if rate else None


def _rates_agree(stream) -> bool:
    """FFmpeg's r_frame_rate (base_rate) and the average rate agree: a constant rate (their
    differing is the tell-tale of variable rate)."""
    base, avg = stream.base_rate, stream.average_rate
    return bool(base and avg) and abs(base / avg - 1) < 1e-3


def _estimate_frame_count(stream, container, fps: Fraction) -> tuple[int, bool]:
    """(count, exact): the container's count (exact in MP4/MOV; elsewhere an estimate: AVI's counts
    the empty chunks of dropped frames), else duration x rate."""
    if stream.frames and stream.frames > 0 and "mp4" in container.format.name.split(","):
        return int(stream.frames), True
    if stream.frames and stream.frames > 0:
        return int(stream.frames), False
    if stream.duration and stream.time_base:
        return max(1, round(stream.duration * stream.time_base * fps)), False
    if container.duration:
        return max(1, round(Fraction(container.duration, 1_000_000) * fps)), False
    return 1, False  # unknown: count_frames() finds out


def _video_duration(stream, container) -> Fraction | None:
    """Seconds of video: the stream's duration, Matroska's DURATION tag, or the container's
    (which may include longer audio; then seeking is just switched off, never wrong)."""
    if stream.duration and stream.time_base:
        return stream.duration * stream.time_base
    tag = stream.metadata.get("DURATION") or stream.metadata.get("duration")
    if tag:
        m = re.fullmatch(r"(\d+):(\d\d):(\d\d(?:\.\d+)?)", tag.strip())
        if m:
            return (int(m[1]) * 3600 + int(m[2]) * 60) + Fraction(m[3])
    if container.duration:
        return Fraction(container.duration, 1_000_000)
    return None


def _pixel_layout(fmt) -> tuple[int, int]:
    """(channels, bit depth) for frames of FFmpeg pixel format ``fmt``. Alpha -> 4 channels
    (gray+alpha too: it becomes RGBA); one luma plane, no chroma -> gray; anything else -> RGB. More
    than 8 bits per component -> 16-bit frames."""
    components = list(fmt.components)
    alpha = any(c.is_alpha for c in components)
    colour = [c for c in components if not c.is_alpha]
    gray = len(colour) == 1 and not fmt.has_palette
    channels = 4 if alpha else (1 if gray else 3)
    bit_depth = 16 if max(c.bits for c in components) > 8 else 8
    return channels, bit_depth


def _source_colour_kwargs(frame) -> dict:
    """YUV->RGB matrix for untagged video: BT.709 for HD, BT.601 below, as players assume. Tagged
    frames are converted by their own tags (PyAV's default). swscale would use BT.601 for every
    untagged frame, which shifts colours of untagged HD video."""
    fmt = frame.format
    # 2 is "unspecified"; 0 ("RGB") on a YUV format is a bogus tag, so treat it the same.
    if fmt.is_rgb or len(fmt.components) < 3 or frame.colorspace not in (0, 2):
        return {}  # RGB and gray sources have no matrix; tagged YUV converts by its tags
    return {"src_colorspace": "ITU709"} if frame.height >= 720 or frame.width >= 1280 else {}


def _colour(frame) -> Colour:
    """The colour description of a decoded frame; RGB and gray sources have no matrix."""
    fmt = frame.format
    if fmt.is_rgb or len(fmt.components) < 3:
        return Colour.tagged(2, frame.color_primaries, frame.color_trc, 0)
    return Colour.tagged(frame.colorspace, frame.color_primaries, frame.color_trc,
                         frame.color_range)


def _ffmpeg_message(e: Exception) -> str:
    """FFmpeg's own words without PyAV's errno prefix and the repeated file name."""
    text = getattr(e, "strerror", None) or str(e)
    return text.replace(os.linesep, " ")
