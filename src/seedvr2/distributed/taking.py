"""Chunks taken, not dealt: each rank takes the plan's next chunk when it is ready for one (a
counter in the process group's store), so a slow rank takes fewer chunks instead of setting
everyone's pace. The writer receives them in plan order, computing chunks ahead while it waits, and
computes a lost rank's undelivered batches itself (docs/multi-gpu.md). Only sequence-parallel
groups, which must meet in every batch, are dealt theirs (:func:`assign_batches`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from ..pipeline.plan import BatchPlan
from . import frames as wire
from .peers import JobKeys, Liveness, RankLost, first_line

log = logging.getLogger("seedvr2")

LOOKAHEAD_CHUNKS = 2  # chunks the writer may compute ahead while waiting for an earlier one


def assign_batches(plan: BatchPlan, world_size: int, first_chunk: int = 0) -> list[list[int]]:
    """Batch indices per rank (or group): the plan's chunks from ``first_chunk`` on (those
    before are complete in a resumed job) dealt out in turn, so the writer takes batches in
    order as they finish and ranks get equal work to within a chunk."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i, chunk in enumerate(plan.chunks[first_chunk:]):
        shares[i % world_size].extend(chunk)
    return shares


class ChunkCounter:
    """The job's keys for taking chunks: the next one, and who took each. Chunks before
    ``first`` (complete in a resumed job) are never handed out."""

    def __init__(self, keys: JobKeys, chunks: int, first: int = 0):
        self.keys, self.store, self.prefix = keys, keys.store, keys.prefix
        self.chunks, self.first = chunks, first

    def take(self, rank: int) -> int | None:
        """The next chunk nobody has taken, now this rank's; None when all are taken."""
        chunk = self.first + self.store.add(self.prefix + "next", 1) - 1
        if chunk >= self.chunks:
            return None
        self.store.set(self.prefix + f"owner/{chunk}", str(rank))
        return chunk

    def handed_out(self) -> int:
        """Chunks handed out so far (those before ``first`` included)."""
        return self.first + self.store.add(self.prefix + "next", 0)

    def all_taken(self) -> bool:
        return self.handed_out() >= self.chunks

    def owner(self, chunk: int) -> int | None:
        """Who took ``chunk``; None while nobody has recorded it."""
        key = self.prefix + f"owner/{chunk}"
        return int(self.store.get(key)) if self.store.check([key]) else None


class Watchdog:
    """Around a blocking receive from ``rank`` (gloo's cannot be interrupted), a thread watches
    it: lost and on this machine, it is killed, so the receive fails at once; elsewhere the
    receive ends at the frame group's timeout (docs/multi-gpu.md#a-node-cut-off-the-network)."""

    def __init__(self, liveness: Liveness, rank: int):
        self.liveness, self.rank = liveness, rank
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="seedvr2-watchdog", daemon=True)

    def _watch(self):
        while not self._done.wait(0.5):
            try:
                self.liveness.check(self.rank)
            except RankLost:
                self.liveness.stop(self.rank)
                return
            except Exception:  # noqa: BLE001 -- the store failed: this rank's Lifeline decides
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()


def _slowed(delay: float, outputs):
    for batch, out in outputs:
        if delay:
            time.sleep(delay)
        yield batch, out


def chunk_outputs(rank: int, counter: ChunkCounter, plan, compute, faults):
    """A non-writer rank's (batch, frames) of every chunk it takes, through ``compute``."""
    while (chunk := counter.take(rank)) is not None:
        yield from _slowed(faults.slowness(rank), compute(list(plan.chunks[chunk])))


class ChunkCollector:
    """The writer's side: ``(batch, frames)`` of every batch of chunks ``counter.first``… in
    plan order (:meth:`outputs`), taken here, received, or computed here for a lost rank;
    while it waits it computes chunks ahead (``held``)."""

    def __init__(self, work, links, counter: ChunkCounter, compute):
        self.rank, self.plan, self.faults = work.ctx.rank, work.plan, work.job.faults
        self.frame_shape, self.group, self.handover = work.frame_shape, links.frames_group, \
            links.handover
        self.counter, self.compute = counter, compute
        self.timeout_s = work.job.opts.dist_timeout
        self.liveness = links.liveness
        self.held: dict[int, list] = {}  # chunk -> this rank's outputs computed ahead of their turn
        self.lost: dict[int, str] = {}  # rank -> why
        self.redone: Counter = Counter()  # lost rank -> its batches computed here
        self.taken: Counter = Counter()  # rank -> chunks it took, for the log

    def own(self, batches):
        return _slowed(self.faults.slowness(self.rank), self.compute(batches))

    def take_ahead(self) -> bool:
        if len(self.held) >= LOOKAHEAD_CHUNKS or (ahead := self.counter.take(self.rank)) is None:
            return False
        self.held[ahead] = list(self.own(list(self.plan.chunks[ahead])))
        return True

    def lose(self, e: RankLost):
        if e.rank not in self.lost:
            self.lost[e.rank] = e.reason
            self.liveness.stop(e.rank)
            log.warning("%s; rank %d computes its unfinished batches", e, self.rank)

    def owner_of(self, index: int) -> int:
        """Who has chunk ``index``; -1 when its taker was lost before saying so."""
        waited = None
        while (owner := self.counter.owner(index)) is None:
            if self.counter.handed_out() <= index:  # nobody has it yet: take it (or a later one)
                chunk = self.counter.take(self.rank)
                if chunk is not None and chunk != index:
                    self.held[chunk] = list(self.own(list(self.plan.chunks[chunk])))
                continue
            # Taken, its taker not recorded yet (about to be, or died): compute ahead, bounded.
            waited = waited or time.monotonic()
            if time.monotonic() - waited > self.timeout_s:
                return -1
            if not self.take_ahead():
                time.sleep(0.05)
        return owner

    def receive(self, owner: int, batch):
        """The batch's message from ``owner``, computing chunks ahead until it is posted."""
        self.handover.wait_posted(batch.index, owner, meanwhile=self.take_ahead)
        self.handover.receiving(batch.index)
        with Watchdog(self.liveness, owner):
            try:
                return wire.recv_batch(owner, batch.index, (batch.frames, *self.frame_shape),
                                       self.group)
            except Exception as e:  # noqa: BLE001 -- a receive fails when its sender is lost
                raise RankLost(owner, f"did not deliver batch {batch.index} (frames "
                                      f"{batch.start}-{batch.stop - 1}): {first_line(e)}") from e

    def chunk(self, index: int):
        """``(batch, frames)`` of chunk ``index``: computed here, or received from its owner
        up to that owner's loss."""
        batches = list(self.plan.chunks[index])
        owner = self.owner_of(index)
        self.taken[owner] += 1
        if owner < 0:
            self.lose(RankLost(-1, f"took chunk {index} and was lost before recording itself"))
        outputs = iter(self.held.pop(index) if index in self.held else self.own(batches)) \
            if owner == self.rank else None
        for position, b in enumerate(batches):
            batch = self.plan.batches[b]
            if outputs is None:
                try:
                    if owner in self.lost:
                        raise RankLost(owner, self.lost[owner])
                    out = self.receive(owner, batch)
                except RankLost as e:
                    self.lose(e)
                    self.redone[owner] += len(batches) - position
                    outputs = iter(self.own(batches[position:]))
            if outputs is not None:
                done, out = next(outputs)
                assert done.index == b, (done.index, b)
            yield batch, out

    def outputs(self):
        for written, (batch, out) in enumerate(
                (item for index in range(self.counter.first, len(self.plan.chunks))
                 for item in self.chunk(index))):
            self.faults.fault_point(self.rank, written)
            yield batch, out
        log.info("chunks taken: %s", ", ".join(f"rank {r}: {n}" for r, n in
                                              sorted(self.taken.items()) if r >= 0))
        for rank, reason in self.lost.items():
            log.warning("%s: rank %d computed its %d unfinished batch(es) itself; every frame "
                        "is written", RankLost(rank, reason), self.rank, self.redone[rank])
