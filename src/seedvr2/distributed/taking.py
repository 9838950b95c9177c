"""Chunks taken, not dealt: each rank takes the plan's next chunk when it is ready for one (a
counter in the process group's store), so a slow rank takes fewer chunks instead of setting
everyone's pace. The writer receives them in plan order, computing chunks ahead while it
waits, and computes a lost rank's undelivered batches itself (docs/multi-gpu.md).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter

import torch.distributed as dist

from . import frames as wire

log = logging.getLogger("seedvr2")

LOOKAHEAD_CHUNKS = 2  # chunks the writer may compute ahead while waiting for an earlier one

_jobs = itertools.count()  # every rank runs the same jobs in the same order (folder inputs)


class ChunkCounter:
    """The store keys of one job: the next chunk to take, and who took each. Chunks before
    ``first`` (complete in a resumed job) are never handed out."""

    def __init__(self, chunks: int, first: int = 0):
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"seedvr2/job{next(_jobs)}/"
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

    def mark_sent(self, batch_index: int):
        """Tell the writer that this batch's message is posted: it may block on it now."""
        self.store.set(self.prefix + f"sent/{batch_index}", "1")


def _process_here() -> str:
    """Where this process runs, comparable between ranks: a pid means the same process only
    in the same pid namespace of the same running kernel (containers share a host name)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, namespace = "", 0
    return f"{socket.gethostname()}|{boot}|{namespace}"


class RankLost(Exception):
    """``rank`` (-1: a rank not known) is lost: exited, frozen, or its receive failed."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"{'a rank' if rank < 0 else f'rank {rank}'} {reason}")
        self.rank, self.reason = rank, reason


class Heartbeat:
    """While a rank works, a thread counts up its key in the store every second: a frozen
    rank stops counting, a slow one does not. The rank also publishes where it runs."""

    PERIOD_S = 1.0

    def __init__(self, counter: ChunkCounter, rank: int):
        self.store, self.key = counter.store, counter.prefix + f"alive/{rank}"
        self.store.set(counter.prefix + f"where/{rank}", _where(os.getpid()))
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


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first); None when the
    process is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def _where(pid: int) -> str:
    """Where a process runs and which one it is: its machine (:func:`_process_here`), pid and
    start time (so that a pid the kernel has given to a later process is not taken for it)."""
    fields = _stat(pid)
    return f"{_process_here()}|{pid}|{fields[19] if fields else ''}"


def _running(pid: int, start: str) -> bool:
    """Whether the process ``pid`` started at ``start`` still runs (a zombie does not: it
    will never run again)."""
    fields = _stat(pid)
    if fields is not None:
        return fields[0] not in ("Z", "X") and (not start or fields[19] == start)
    if os.path.isdir("/proc"):
        return False
    try:  # no /proc: ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Liveness:
    """The writer's view of the other ranks: one whose process has exited (on this machine)
    or whose heartbeat has not moved for ``timeout_s`` is lost."""

    def __init__(self, counter: ChunkCounter, timeout_s: float):
        self.store, self.prefix, self.timeout_s = counter.store, counter.prefix, timeout_s
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)
        self._here = _process_here()

    def local_process(self, rank: int) -> tuple[int, str] | None:
        """The rank's (pid, start time) when it runs on this machine (pid namespace
        included), else None."""
        key = self.prefix + f"where/{rank}"
        if not self.store.check([key]):
            return None
        where, pid, start = self.store.get(key).decode().rsplit("|", 2)
        return (int(pid), start) if where == self._here else None

    def check(self, rank: int):
        """Raises :class:`RankLost` when ``rank`` has exited or frozen."""
        process = self.local_process(rank)
        if process is not None and not _running(*process):
            raise RankLost(rank, "exited")
        count = self.store.add(self.prefix + f"alive/{rank}", 0)
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or last[0] != count:
            self.seen[rank] = (count, now)
        elif now - last[1] > self.timeout_s:
            raise RankLost(rank, f"has shown no sign of life for dist_timeout "
                                 f"({self.timeout_s:g}s): frozen or hung")

    def stop(self, rank: int) -> bool:
        """Kill ``rank`` if it runs on this machine: a frozen rank must not wake up later and
        take chunks, and its death ends any receive blocked on it. False when it cannot be.
        Only the very process is killed: once it has exited, its pid may name another."""
        process = self.local_process(rank)
        if process is None:
            return False
        if _running(*process):
            try:
                os.kill(process[0], signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True


class Watchdog:
    """Around a blocking wait for rank ``rank``'s frames (gloo's point-to-point operations
    cannot be polled or interrupted), a thread watches that rank. When it is lost: with
    ``stop_lost`` and the rank on this machine, it kills it, so the wait raises and the caller
    carries on without it; otherwise it ends this process with an error naming the rank."""

    def __init__(self, liveness: Liveness, rank: int, what: str, stop_lost: bool = False):
        self.liveness, self.rank, self.what, self.stop_lost = liveness, rank, what, stop_lost
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="seedvr2-watchdog", daemon=True)

    def _watch(self):
        while not self._done.wait(0.5):
            try:
                self.liveness.check(self.rank)
            except RankLost as e:
                if self.stop_lost and self.liveness.stop(self.rank):
                    return
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


def _slowed(delay: float, outputs):
    for batch, out in outputs:
        if delay:
            time.sleep(delay)
        yield batch, out


def chunk_outputs(rank: int, counter: ChunkCounter, plan, compute, faults):
    """A non-writer rank's batches: (batch, frames) of every chunk it takes, in order.
    ``compute(batches)`` yields the outputs of those plan batch indices."""
    while (chunk := counter.take(rank)) is not None:
        yield from _slowed(faults.slowness(rank), compute(list(plan.chunks[chunk])))


class ChunkCollector:
    """The writer's side: take chunks, receive the others', and yield ``(batch, frames)`` for
    every batch of chunks ``counter.first``… in plan order (:meth:`outputs`), computing chunks
    ahead while it waits (``held``) and a lost rank's undelivered batches; the log says so."""

    def __init__(self, work, counter: ChunkCounter, compute):
        self.rank, self.plan, self.faults = work.ctx.rank, work.plan, work.job.faults
        self.frame_shape, self.group = work.frame_shape, work.frames_group
        self.counter, self.compute = counter, compute
        self.timeout_s = work.job.opts.dist_timeout
        self.liveness = Liveness(counter, self.timeout_s)
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
            # Taken, but the taker has not recorded itself: it is about to, or it died in
            # between. Meanwhile compute ahead, bounded.
            waited = waited or time.monotonic()
            if time.monotonic() - waited > self.timeout_s:
                return -1
            if not self.take_ahead():
                time.sleep(0.05)
        return owner

    def receive(self, owner: int, batch):
        """The batch's message from ``owner``; while it is not there, compute chunks ahead
        (bounded) and watch that ``owner`` is alive."""
        sent = self.counter.prefix + f"sent/{batch.index}"
        # gloo's receives cannot be polled: the sender marks the store once it has posted.
        while not self.counter.store.check([sent]):
            self.liveness.check(owner)
            if not self.take_ahead():
                time.sleep(0.05)
        with Watchdog(self.liveness, owner, f"waiting for rank {owner}'s batch {batch.index}",
                      stop_lost=True):
            try:
                return wire.recv_batch(owner, batch.index, (batch.frames, *self.frame_shape),
                                       self.group)
            except Exception as e:  # noqa: BLE001 -- a receive fails when its sender died
                detail = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise RankLost(owner, f"did not deliver batch {batch.index} (frames "
                                      f"{batch.start}-{batch.stop - 1}): {detail}") from e

    def chunk(self, index: int):
        """``(batch, frames)`` of chunk ``index``: computed here (ahead, or now), or received
        from its owner; from a lost owner's first undelivered batch on, computed here."""
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
