"""The writer's side of chunk taking, in one process against an in-memory store: chunks of a
lost rank (exited, or lost before it recorded itself as a chunk's taker) are computed by the
writer, and every batch still comes out once, in plan order."""

from __future__ import annotations

import os
import subprocess
import sys

from types import SimpleNamespace

import pytest

from seedvr2.distributed import frames, peers, taking
from seedvr2.distributed.groups import DistContext
from seedvr2.faults import Faults
from seedvr2.options import resolve_options
from seedvr2.pipeline.plan import make_plan


class MemoryStore:
    """The four store calls the taking code makes, as TCPStore answers them."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def add(self, key: str, amount: int) -> int:
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value

    def set(self, key: str, value: str):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


def _counter(chunks: int, first: int = 0) -> taking.ChunkCounter:
    return taking.ChunkCounter(peers.JobKeys(MemoryStore()), chunks, first)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()  # reaped: the pid names no process now
    return process.pid


def _run(counter, plan, computed):
    def compute(batches):
        computed.extend(batches)
        return ((plan.batches[b], f"frames of {b}") for b in batches)
    ctx = DistContext(rank=0, world_size=2, local_rank=0, device=None)
    job = SimpleNamespace(faults=Faults(), opts=SimpleNamespace(dist_timeout=0.5))
    work = SimpleNamespace(ctx=ctx, job=job, plan=plan, frame_shape=(32, 32, 3))
    liveness = peers.Liveness(counter.keys, job.opts.dist_timeout)
    links = SimpleNamespace(frames_group=None, liveness=liveness,
                            handover=frames.Handover(counter.keys, liveness))
    return list(taking.ChunkCollector(work, links, counter, compute).outputs())


@pytest.fixture
def plan():
    plan = make_plan(23, resolve_options(batch_size=5, temporal_overlap=1, chunk_size=9,
                                         scene_cuts="off"))
    assert [list(c) for c in plan.chunks] == [[0, 1], [2, 3], [4, 5]]
    return plan


def test_chunks_of_an_exited_rank_are_computed_by_the_writer(plan, caplog):
    counter = _counter(len(plan.chunks))
    assert counter.take(1) == 0  # rank 1 took the first chunk, then its process ended
    counter.store.set(counter.prefix + "where/1", peers.where(_dead_pid()))
    computed = []
    with caplog.at_level("INFO", logger="seedvr2"):
        out = _run(counter, plan, computed)
    assert [(batch.index, frames) for batch, frames in out] == [
        (b, f"frames of {b}") for b in range(6)]
    assert sorted(computed) == list(range(6))  # nothing twice
    assert "rank 1 exited: rank 0 computed its 2 unfinished batch(es) itself" in caplog.text


def test_a_lost_rank_is_known_by_pid_and_start_time():
    """A rank's process is told from a later one the kernel gives the same pid: only the very
    process counts as running, and only it would be killed."""
    counter = _counter(3)
    counter.store.set(counter.prefix + "where/1", peers.where(os.getpid()))
    liveness = peers.Liveness(counter.keys, timeout_s=60)
    liveness.check(1)  # this very process: running
    here, pid, start = counter.store.get(counter.prefix + "where/1").decode().rsplit("|", 2)
    assert int(pid) == os.getpid() and start
    reused = f"{here}|{pid}|{int(start) + 1}"  # the same pid, started at another time
    counter.store.set(counter.prefix + "where/1", reused)
    with pytest.raises(peers.RankLost, match="rank 1 exited"):
        liveness.check(1)
    assert liveness.stop(1)  # "stopped": gone already, and nothing was killed (we still run)
    counter.store.set(counter.prefix + "where/1", f"another machine|{pid}|{start}")
    assert liveness.local_process(1) is None and not liveness.stop(1)


def test_a_taker_lost_before_recording_itself(plan, caplog):
    counter = _counter(len(plan.chunks), first=1)  # a resumed job: chunk 0 is complete
    counter.store.add(counter.prefix + "next", 1)  # chunk 1 handed out, no owner recorded
    computed = []
    with caplog.at_level("INFO", logger="seedvr2"):
        out = _run(counter, plan, computed)
    assert [batch.index for batch, _ in out] == [2, 3, 4, 5]
    assert sorted(computed) == [2, 3, 4, 5]
    assert "a rank took chunk 1 and was lost before recording itself" in caplog.text


def test_decode_times_rebuilt_below_presentation_times():
    from seedvr2.io.segments import _decode_times

    class Packet:
        def __init__(self, pts):
            self.pts, self.dts = pts, None
    # Decode order of a B-frame GOP shifted to 233: the first two decode times were negative.
    leading = [Packet(233), Packet(266)]
    _decode_times(leading, 233)
    assert [p.dts for p in leading] == [231, 232]  # increasing, below 233 and every pts
    tail = [Packet(400), Packet(500)]  # a segment without any decode time
    _decode_times(tail, None)
    assert [p.dts for p in tail] == [398, 499]
    assert all(p.dts <= p.pts for p in leading + tail)
