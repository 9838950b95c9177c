"""Chunks taken, not dealt: each rank takes the plan's next chunk when it is ready for one.

A counter in the process group's store hands out chunk indices (``store.add`` is atomic), and
the taker records itself as the chunk's owner, so the writer (rank 0) knows whom to receive
each chunk from. A slow rank therefore takes fewer chunks instead of setting everyone's pace.

The writer still delivers batches in plan order and memory stays bounded: while it waits
for a chunk that another rank is computing, it takes and computes up to
:data:`LOOKAHEAD_CHUNKS` further chunks itself and keeps their frames until their turn; other
ranks hold one finished batch in flight, as before. Results are the same frames whichever
rank computes a batch (per-batch seeds), so taking changes speed only.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections import Counter

import torch.distributed as dist

from ..pipeline.runner import OverlapBlender
from . import frames as wire

log = logging.getLogger("seedvr2")

LOOKAHEAD_CHUNKS = 2  # chunks the writer may compute ahead while waiting for an earlier one
SLOW_ENV = "SEEDVR2_SLOW"  # test hook, "RANK:SECONDS": that rank sleeps this long per batch

_jobs = itertools.count()  # every rank runs the same jobs in the same order (folder inputs)


class ChunkCounter:
    """The store keys of one job: the next chunk to take, and who took each."""

    def __init__(self, chunks: int):
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"seedvr2/job{next(_jobs)}/"
        self.chunks = chunks
        self.taken: Counter = Counter()  # writer only: chunks per rank, for the summary

    def take(self, rank: int) -> int | None:
        """The next chunk nobody has taken, now this rank's; None when all are taken."""
        chunk = self.store.add(self.prefix + "next", 1) - 1
        if chunk >= self.chunks:
            return None
        self.store.set(self.prefix + f"owner/{chunk}", str(rank))
        return chunk

    def owner(self, chunk: int, wait: bool = True) -> int | None:
        """Who took ``chunk``; without ``wait``, None while nobody has."""
        key = self.prefix + f"owner/{chunk}"
        if not wait and not self.store.check([key]):
            return None
        rank = int(self.store.get(key))
        self.taken[rank] += 1
        return rank


def _slowness(rank: int) -> float:
    spec = os.environ.get(SLOW_ENV, "")
    if spec and spec.partition(":")[0] == str(rank):
        return float(spec.partition(":")[2])
    return 0.0


class Heartbeat:
    """While a rank works, a thread counts up its key in the store every second. A rank that
    is frozen (SIGSTOP, a hung process) stops counting; one that is merely slow (a long chunk
    on a big GPU job) keeps counting, so waiting for its frames is not mistaken for death."""

    PERIOD_S = 1.0

    def __init__(self, counter: ChunkCounter, rank: int):
        self.store, self.key = counter.store, counter.prefix + f"alive/{rank}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="seedvr2-heartbeat", daemon=True)

    def _beat(self):
        while not self._stop.is_set():
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 -- the store went away: the job is ending
                return
            self._stop.wait(self.PERIOD_S)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


class Liveness:
    """The writer's view of the others' heartbeats: a rank whose count has not moved for
    ``timeout_s`` is frozen."""

    def __init__(self, counter: ChunkCounter, timeout_s: float):
        self.store, self.prefix, self.timeout_s = counter.store, counter.prefix, timeout_s
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)

    def check(self, rank: int):
        count = self.store.add(self.prefix + f"alive/{rank}", 0)
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or last[0] != count:
            self.seen[rank] = (count, now)
        elif now - last[1] > self.timeout_s:
            raise TimeoutError(f"rank {rank} has shown no sign of life for dist_timeout "
                               f"({self.timeout_s:g}s): frozen or hung")


class Watchdog:
    """Around a blocking wait for rank ``rank``'s frames: gloo's point-to-point operations
    cannot be polled or interrupted, so a thread watches that rank's heartbeat meanwhile and,
    when it has stopped for ``dist_timeout``, ends this process with an error naming the rank
    (the launchers then stop the rest; a temporary left behind is removed by the launcher or by
    the next run of the same output)."""

    def __init__(self, liveness: Liveness, rank: int, what: str):
        self.liveness, self.rank, self.what = liveness, rank, what
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="seedvr2-watchdog", daemon=True)

    def _watch(self):
        while not self._done.wait(0.5):
            try:
                self.liveness.check(self.rank)
            except TimeoutError as e:
                sys.stderr.write(f"error: {self.what}: {e}\n")
                sys.stderr.flush()
                os._exit(3)
            except Exception:  # noqa: BLE001 -- the store went away: the job is ending anyway
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()


def mark_sent(counter: ChunkCounter, batch_index: int):
    """Tell the writer that this batch's message is posted: it may block on it now."""
    counter.store.set(counter.prefix + f"sent/{batch_index}", "1")


def chunk_outputs(ctx, counter: ChunkCounter, plan, compute):
    """A non-writer rank's batches: (batch, frames) of every chunk it takes, in order.
    ``compute(chunk)`` yields the chunk's batch outputs."""
    delay = _slowness(ctx.rank)
    while (chunk := counter.take(ctx.rank)) is not None:
        for batch, out in compute(chunk):
            if delay:
                time.sleep(delay)
            yield batch, out


def gather_taken(ctx, counter: ChunkCounter, plan, compute, sink, channels: int, size,
                 progress, group, fault_point, timeout_s: float):
    """The writer's side: take chunks, receive the others' in plan order, blend, ``sink``."""
    blender = OverlapBlender(plan)
    held: dict[int, list] = {}  # chunk -> this rank's outputs computed ahead of their turn
    delay = _slowness(ctx.rank)
    written = 0

    def own(chunk: int):
        for batch, out in compute(chunk):
            if delay:
                time.sleep(delay)
            yield batch, out

    def deliver(batch, out):
        nonlocal written
        fault_point(ctx, written)
        for first, final in blender.add(batch, out):
            sink(first, final)
            if progress:
                progress("frames", blender.emitted, plan.source_frames)
        written += 1

    liveness = Liveness(counter, timeout_s)

    def receive(owner: int, batch):
        """The batch's message from ``owner``; while it is not there, compute chunks ahead
        (bounded) and watch that ``owner`` is alive."""
        sent = counter.prefix + f"sent/{batch.index}"
        # gloo's receives cannot be polled: the sender marks the store once it has posted.
        while not counter.store.check([sent]):
            liveness.check(owner)
            if len(held) < LOOKAHEAD_CHUNKS and (ahead := counter.take(ctx.rank)) is not None:
                held[ahead] = list(own(ahead))
            else:
                time.sleep(0.05)
        with Watchdog(liveness, owner, f"waiting for rank {owner}'s batch {batch.index}"):
            return wire.recv_batch(owner, batch.index, (batch.frames, *size, channels), group)

    for index, chunk in enumerate(plan.chunks):
        owner = counter.owner(index, wait=False)
        while owner is None:  # nobody has it yet: take the next chunk ourselves
            taken = counter.take(ctx.rank)
            if taken is None:
                owner = counter.owner(index)
            elif taken == index:
                owner = counter.owner(index)
            else:  # another rank took this one between our look and our take
                held[taken] = list(own(taken))
                owner = counter.owner(index, wait=False)
        if owner == ctx.rank:
            for batch, out in (held.pop(index) if index in held else own(index)):
                deliver(batch, out)
            continue
        for b in chunk:
            batch = plan.batches[b]
            try:
                out = receive(owner, batch)
            except Exception as e:
                raise RuntimeError(
                    f"rank {owner} did not deliver batch {b} (frames {batch.start}-"
                    f"{batch.stop - 1}): it failed or timed out ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''})") from e
            deliver(batch, out)
    log.info("chunks taken: %s", ", ".join(f"rank {r}: {n}" for r, n in sorted(counter.taken.items())))
