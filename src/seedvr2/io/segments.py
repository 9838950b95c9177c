"""A video assembled from closed segments by stream copy: nothing is decoded or re-encoded. A
resumable job writes its output as consecutive segment files (docs/resume.md);
:class:`SegmentConcat` joins them, copying the source's audio in alongside, with the writers'
temporary -> final protocol."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

from ._common import VIDEO_EXTENSIONS, MediaError, as_fraction, fspath
from .writer import MediaWriter, OutputSpec, _AudioCopy, shift_times


def sync_file(path: Path):
    """Flush a closed file's data to the disk, so that a journal naming it never outlives it
    after a power cut (a kill -9 alone cannot lose written data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentConcat(MediaWriter):
    """Writes ``dst`` from ``segments`` (video files of ``counts`` frames each, in order), as
    ``spec`` (resolved: :meth:`OutputSpec.resolved`) describes it. Each segment's timestamps start
    at 0 and are shifted by its first frame's time: ``spec.frame_times[first]`` for variable-rate
    video (seconds from the source's first frame), else ``first / fps``. ``spec.audio_from``'s audio
    streams (and ``subtitle_streams``) are copied in; ``after_segment(n)`` is told that the first n
    segments are in (the tests' kill point)."""

    def __init__(self, dst, segments: list[Path], counts: list[int], spec: OutputSpec, *,
                 overwrite: bool = False, after_segment=None):
        path = fspath(dst)
        super().__init__(path, spec, overwrite=overwrite)
        if path.suffix.lower() not in VIDEO_EXTENSIONS:
            raise MediaError(f"{path}: segments are joined into videos only")
        self._segments, self._counts = list(segments), list(counts)
        self._after_segment = after_segment or (lambda segments: None)
        self._claim_temp()
        self.frames_written = sum(self._counts)

    def _finish(self) -> None:
        import av

        ext = self.path.suffix.lower()
        with av.open(str(self._temp), "w", format=VIDEO_EXTENSIONS[ext]) as out:
            with av.open(str(self._segments[0])) as first:
                template = first.streams.video[0]
                # The template carries the segments' display matrix (rotation and mirror)
                # and sample aspect ratio: setting a rotation here would drop a mirror.
                video = out.add_stream_from_template(template)
            source = self.spec.audio_from
            audio = _AudioCopy(fspath(source), out, self.path, self.spec.subtitle_streams) \
                if source is not None else None
            try:
                frames_before = 0
                for number, (segment, count) in enumerate(zip(self._segments, self._counts)):
                    self._copy(segment, out, video, audio, frames_before)
                    frames_before += count
                    self._after_segment(number + 1)
                if audio is not None:
                    audio.mux_until(None)
            finally:
                if audio is not None:
                    audio.close()
        self._state = "kept"
        self._place(self._temp, self.path)

    def _copy(self, segment: Path, out, video, audio, frames_before: int):
        import av

        with av.open(str(segment)) as source:
            stream = source.streams.video[0]
            times = self.spec.frame_times
            start = Fraction(times[frames_before]) if times \
                else Fraction(frames_before) / as_fraction(self.spec.fps)
            shift = round(start / stream.time_base)
            leading = []  # packets before the first one with a decode time (see _decode_times)

            def mux(packet):
                seconds = packet.pts * stream.time_base if packet.pts is not None else None
                packet.stream = video
                out.mux(packet)
                if audio is not None and seconds is not None:
                    audio.mux_until(seconds)
            for packet in source.demux(stream):
                if packet.size == 0:  # the demuxer's end-of-stream marker
                    continue
                shift_times(packet, shift)
                if packet.dts is None:
                    leading.append(packet)
                    continue
                _decode_times(leading, packet.dts)
                for waiting in [*leading, packet]:
                    mux(waiting)
                leading = []
            _decode_times(leading, None)
            for waiting in leading:
                mux(waiting)
        del av


def _decode_times(packets, known_dts):
    """Give ``packets`` (the first of a segment, in decode order) the decode times Matroska does not
    store: with B-frames a segment's first decode times precede its first presentation time, so they
    are negative, and the demuxer reports none. Joined after another segment, a packet without one
    is refused. Each gets one tick less than the next, below both the first known decode time and
    every later presentation time of the group, so decode times increase and never pass presentation
    times; the gap to the previous segment is at least a frame, more than these few ticks."""
    bound = known_dts
    for j in range(len(packets) - 1, -1, -1):
        pts = packets[j].pts
        if pts is not None:
            bound = pts if bound is None else min(bound, pts)
        packets[j].dts = bound - (len(packets) - j)
