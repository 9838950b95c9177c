"""Encoding on a thread: frames in order, a bounded queue, errors raised in the caller's
thread, and no partial output left behind."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from seedvr2.io import OutputSpec, open_media, open_writer
from seedvr2.io.background import BackgroundWriter

PNG_SPEC = OutputSpec(width=8, height=8, channels=3, bit_depth=8)


class FakeWriter:
    def __init__(self, fail_at=None, gate=None):
        self.frames, self.state, self.fail_at, self.gate = [], "open", fail_at, gate
        self.path = "fake"
        self.threads = set()

    @property
    def frames_written(self):
        return len(self.frames)

    def write(self, frame):
        self.threads.add(threading.get_ident())
        if self.gate is not None:
            self.gate.wait(5)
        if len(self.frames) == self.fail_at:
            raise OSError(f"disk full at frame {self.fail_at}")
        self.frames.append(frame)

    def close(self):
        self.state = "closed"

    def abort(self):
        self.state = "aborted"


def test_frames_are_encoded_in_order_off_the_callers_thread():
    fake = FakeWriter()
    with BackgroundWriter(fake, max_pending=2) as out:
        out.write_many(np.full((1, 1, 1), i, np.uint8) for i in range(20))
    assert [int(f[0, 0, 0]) for f in fake.frames] == list(range(20))
    assert fake.state == "closed" and threading.get_ident() not in fake.threads


def test_the_queue_is_bounded():
    gate = threading.Event()
    fake = FakeWriter(gate=gate)
    out = BackgroundWriter(fake, max_pending=2)
    done = []
    # One frame in the encoder (held at the gate) and two queued; the fourth must wait.
    feeder = threading.Thread(target=lambda: (out.write_many([np.zeros(1)] * 4), done.append(1)))
    feeder.start()
    time.sleep(0.5)
    assert not done
    gate.set()
    feeder.join(5)
    assert done
    out.close()
    assert len(fake.frames) == 4


def test_an_encoding_error_surfaces_in_the_callers_thread_and_aborts():
    fake = FakeWriter(fail_at=3)
    with pytest.raises(OSError, match="disk full at frame 3"):
        with BackgroundWriter(fake, max_pending=2) as out:
            for i in range(50):
                out.write(np.zeros(1))
                time.sleep(0.002)
    assert fake.state == "aborted" and len(fake.frames) == 3


def test_an_error_raised_at_close_aborts_too():
    fake = FakeWriter(fail_at=1)
    out = BackgroundWriter(fake)
    out.write_many([np.zeros(1)] * 2)
    with pytest.raises(OSError, match="disk full at frame 1"):
        out.close()
    assert fake.state == "aborted"


def test_a_failure_in_the_caller_discards_queued_frames():
    gate = threading.Event()
    fake = FakeWriter(gate=gate)
    with pytest.raises(ValueError, match="the DiT failed"):
        with BackgroundWriter(fake, max_pending=8) as out:
            out.write_many([np.zeros(1)] * 5)
            gate.set()
            raise ValueError("the DiT failed")
    assert fake.state == "aborted" and len(fake.frames) < 5


def test_real_writer_failure_leaves_no_partial_files(tmp_path, monkeypatch):
    frames = np.zeros((4, 8, 8, 3), np.uint8)
    writer = open_writer(f"{tmp_path}/out/", PNG_SPEC)
    calls = []
    real = type(writer)._write

    def failing(self, frame):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("no space left on device")
        real(self, frame)
    monkeypatch.setattr(type(writer), "_write", failing)
    with pytest.raises(Exception, match="no space left on device"):
        with BackgroundWriter(writer) as out:
            out.write_many(frames)
    assert not any(p for p in tmp_path.rglob("*") if p.is_file())


def test_real_writer_output_is_complete(tmp_path):
    frames = (np.arange(5)[:, None, None, None] * 40 + np.zeros((5, 8, 8, 3))).astype(np.uint8)
    with BackgroundWriter(open_writer(f"{tmp_path}/out/", PNG_SPEC)) as out:
        out.write_many(frames)
    with open_media(f"{tmp_path}/out/%05d.png") as media:
        assert np.array_equal(np.stack(list(media.frames())), frames)
