"""Encode on a thread while the GPU computes the next frames: :class:`BackgroundWriter` wraps any
writer from :func:`~seedvr2.io.open_writer`; an exception while encoding is raised by the caller's
next ``write`` or ``close``, and the output is aborted (docs/media.md#writing)."""

from __future__ import annotations

import queue
import threading

from ..errors import InputError
from ._common import MediaError
from .writer import FrameOutput

_STOP = object()
_POLL_S = 0.1  # how often a blocked put looks whether the encoding thread has died


class BackgroundWriter(FrameOutput):
    def __init__(self, writer, max_pending: int = 8):
        if max_pending < 1:
            raise InputError(f"max_pending must be at least 1, got {max_pending}")
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._discard = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._encode, name="seedvr2-writer", daemon=True)
        self._thread.start()

    @property
    def path(self):
        return self.writer.path

    @property
    def frames_written(self) -> int:
        return self.writer.frames_written

    def _encode(self):
        while True:
            frame = self._queue.get()
            if frame is _STOP:
                return
            if self._discard.is_set():
                continue  # aborting: drop what is queued, keep draining until _STOP
            try:
                self.writer.write(frame)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                self._error = e
                self._discard.set()

    def _raise_if_failed(self):
        if self._error is not None:
            self._stop_thread()
            self._abort_writer()
            raise self._error

    def _put(self, item):
        while True:
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def write(self, frame) -> None:
        """Queue one frame (blocks while ``max_pending`` frames wait)."""
        if self._finished:
            raise MediaError(f"{self.path}: background writer is already closed")
        self._put(frame)

    def _stop_thread(self):
        if not self._thread.is_alive():
            return
        # The thread drains the queue (dropping frames once _discard is set): this put is brief.
        self._queue.put(_STOP)
        self._thread.join()

    def _abort_writer(self):
        self._finished = True
        self.writer.abort()

    def close(self) -> None:
        """Wait for every queued frame to be encoded, then close the wrapped writer."""
        if self._finished:
            return
        self._stop_thread()
        self._raise_if_failed()
        self._finished = True
        self.writer.close()

    def abort(self) -> None:
        """Drop the queued frames and discard the output."""
        if self._finished:
            return
        self._discard.set()
        self._stop_thread()
        self._abort_writer()
