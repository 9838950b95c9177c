"""Read input frames ahead on a thread while the device computes: :class:`ReadAhead` wraps any
frame iterator in a bounded queue, so decoding the next batch's frames overlaps the current
batch's compute. Only the reading thread advances the wrapped iterator, and it closes it
before it ends; ``close()`` waits for that, so the reader's owner may close the reader once it
returns. An exception from the iterator reaches the caller after the items read before it."""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator

_POLL_S = 0.05  # how often a blocked put or get looks whether the other side has stopped


class _Ended:
    """How the wrapped iterator ended: StopIteration, or the error it raised."""

    def __init__(self, error: BaseException):
        self.error = error


class ReadAhead(Iterator):
    """Iterate ``items`` with up to ``depth`` of them read ahead on a background thread."""

    def __init__(self, items: Iterable, depth: int):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._items = iter(items)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._read, name="seedvr2-reader", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _read(self):
        try:
            for item in self._items:
                if not self._put(item):
                    return
            self._put(_Ended(StopIteration()))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
            self._put(_Ended(e))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()

    def __next__(self):
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True  # stopped by close()
                    raise StopIteration from None
        if isinstance(item, _Ended):
            self._done = True
            raise item.error
        return item

    def close(self):
        """Stop reading and wait until the thread has closed the wrapped iterator
        (idempotent; at most the item being read is still read to its end)."""
        self._done = True
        self._stop.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
