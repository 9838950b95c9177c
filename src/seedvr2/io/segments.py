"""A video assembled from closed segments by stream copy: nothing is decoded or re-encoded.

A long job writes its output as consecutive segment files (each a complete video with the
same encoder settings), so that a kill loses at most the segment being written. When every
segment exists, :class:`SegmentConcat` joins their packets into the final file, shifting
each segment's timestamps by the frames before it, copies the source's audio in alongside
(packet for packet, as :class:`~seedvr2.io.writer.VideoWriter` does), and moves the result
into place with the writers' temporary -> final protocol (never a half-written file at the
final name; an existing output replaced only with ``overwrite``).
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

from ._common import VIDEO_EXTENSIONS, MediaError, fspath
from .writer import MediaWriter, _AudioCopy

ASSEMBLY_HOOK_ENV = "SEEDVR2_KILL_IN_ASSEMBLY"  # test hook: SIGKILL after this many segments


def sync_file(path: Path):
    """Flush a closed file's data to the disk, so that a journal naming it never outlives it
    after a power cut (a kill -9 alone cannot lose written data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentConcat(MediaWriter):
    """Writes ``dst`` from ``segments`` (video files of ``counts`` frames each, in order)."""

    def __init__(self, dst, segments: list[Path], counts: list[int], *, fps: Fraction,
                 width: int, height: int, channels: int, bit_depth: int, audio_from=None,
                 rotation: int = 0, overwrite: bool = False):
        path = fspath(dst)
        super().__init__(path, width=width, height=height, channels=channels,
                         bit_depth=bit_depth, overwrite=overwrite)
        if path.suffix.lower() not in VIDEO_EXTENSIONS:
            raise MediaError(f"{path}: segments are joined into videos only")
        self._segments, self._counts = list(segments), list(counts)
        self._fps, self._audio_from, self._rotation = fps, audio_from, rotation
        self._claim_temp_file(path)
        self.frames_written = sum(self._counts)

    def _finish(self) -> None:
        import av

        ext = self.path.suffix.lower()
        with av.open(str(self._temp), "w", format=VIDEO_EXTENSIONS[ext]) as out:
            with av.open(str(self._segments[0])) as first:
                template = first.streams.video[0]
                video = out.add_stream_from_template(template)
            if self._rotation:
                video.set_display_rotation(self._rotation)
            audio = _AudioCopy(fspath(self._audio_from), out, self.path) \
                if self._audio_from is not None else None
            try:
                frames_before = 0
                for number, (segment, count) in enumerate(zip(self._segments, self._counts)):
                    self._copy(segment, out, video, audio, frames_before)
                    frames_before += count
                    if os.environ.get(ASSEMBLY_HOOK_ENV) == str(number + 1):
                        import signal
                        os.kill(os.getpid(), signal.SIGKILL)
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
            shift = round(Fraction(frames_before) / self._fps / stream.time_base)
            for packet in source.demux(stream):
                if packet.size == 0:  # the demuxer's end-of-stream marker
                    continue
                if packet.pts is not None:
                    packet.pts += shift
                if packet.dts is not None:
                    packet.dts += shift
                seconds = packet.pts * stream.time_base if packet.pts is not None else None
                packet.stream = video
                out.mux(packet)
                if audio is not None and seconds is not None:
                    audio.mux_until(seconds)
        del av
