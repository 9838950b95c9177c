"""Who is still in the job. Every rank keeps a :class:`Lifeline` to the job's store: a heartbeat
the others watch (:class:`Liveness`); a rank the store has not answered for ``dist_timeout`` ends
itself. Waits on another rank are polled in the store (:func:`wait_until`), never left to a
collective, so every group keeps the job's timeout (docs/multi-gpu.md#when-a-rank-is-lost)."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

from ..errors import SeedVR2Error

log = logging.getLogger("seedvr2")

_jobs = itertools.count()  # every rank runs the same jobs in the same order (folder inputs)

CUT_OFF_EXIT_CODE = 3  # a rank that lost the job ends with this status


class JobKeys:
    """The job's keys in the process group's store, under this job's own prefix."""

    def __init__(self, store: Optional[dist.Store] = None):
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.prefix = f"seedvr2/job{next(_jobs)}/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def exists(self, name: str) -> bool:
        return self.store.check([self.key(name)])

    def mark(self, name: str):
        self.store.set(self.key(name), "1")


class DistributedError(SeedVR2Error, RuntimeError):
    """A job over several processes that cannot go on (ranks disagree, a stray message, no
    rendezvous, a rank failed)."""


class RankLost(DistributedError):
    """``rank`` (-1: not known) is lost: exited, frozen, cut off, or its transfer failed."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"{'a rank' if rank < 0 else f'rank {rank}'} {reason}")
        self.rank, self.reason = rank, reason


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def store_address(store) -> str:
    """Where a store answers (host:port of the TCPStore under any prefixes), for messages."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None else type(store).__name__


class Lifeline:
    """While a rank works, one thread counts up its key in the store every :data:`PERIOD_S` (a
    frozen rank stops counting, a slow one does not) and another watches the answers: a store
    silent or failing for ``timeout_s`` ends this rank with :data:`CUT_OFF_EXIT_CODE`, from a
    thread, since the main thread may be blocked in a call nothing interrupts (as safe as a kill:
    docs/multi-gpu.md#a-node-cut-off-the-network). It also publishes where the rank runs."""

    PERIOD_S = 1.0

    def __init__(self, keys: JobKeys, rank: int, timeout_s: float):
        self.store, self.key = keys.store, keys.key(f"alive/{rank}")
        self.rank, self.timeout_s = rank, timeout_s
        keys.store.set(keys.key(f"where/{rank}"), where(os.getpid()))
        self.answered = time.monotonic()
        self.trouble = "no answer"  # the store's last error, for the message
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=target, name=f"seedvr2-{name}", daemon=True)
                         for name, target in (("heartbeat", self._beat),
                                              ("lifeline", self._watch))]

    def _beat(self):
        while not self._stop.is_set():
            try:
                self.store.add(self.key, 1)
                self.answered = time.monotonic()
            except Exception as e:  # noqa: BLE001 -- counts as no answer; _watch decides
                self.trouble = first_line(e)
            self._stop.wait(self.PERIOD_S)

    def _watch(self):
        while not self._stop.wait(self.PERIOD_S / 4):
            silent = time.monotonic() - self.answered
            if silent > self.timeout_s and not self._stop.is_set():
                self.end(f"the job's store ({store_address(self.store)}) has not answered for "
                         f"dist_timeout ({self.timeout_s:g}s; last: {self.trouble}): this node "
                         f"is cut off from the job, or its host is gone")

    def end(self, why: str):
        log.error("rank %d lost the job: %s; ending this rank (exit code %d)", self.rank, why,
                  CUT_OFF_EXIT_CODE)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(CUT_OFF_EXIT_CODE)

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


def _process_here() -> str:
    """Where this process runs, comparable between ranks: a pid names one process only in
    one pid namespace of one running kernel (containers share a host name)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        boot, namespace = "", 0
    return f"{socket.gethostname()}|{boot}|{namespace}"


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command (state first); None: gone, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def where(pid: int) -> str:
    """A process's machine (:func:`_process_here`), pid and start time (a reused pid differs)."""
    fields = _stat(pid)
    return f"{_process_here()}|{pid}|{fields[19] if fields else ''}"


def _running(pid: int, start: str) -> bool:
    """Whether the process ``pid`` started at ``start`` still runs (a zombie does not)."""
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
    """One rank's view of the others: one whose process has exited (on this machine) or
    whose heartbeat has not moved for ``timeout_s`` is lost."""

    def __init__(self, keys: JobKeys, timeout_s: float):
        self.keys, self.timeout_s = keys, timeout_s
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)
        self._here = _process_here()

    def local_process(self, rank: int) -> tuple[int, str] | None:
        """The rank's (pid, start time) when it runs on this machine, else None."""
        if not self.keys.exists(f"where/{rank}"):
            return None
        place = self.keys.store.get(self.keys.key(f"where/{rank}")).decode()
        here, pid, start = place.rsplit("|", 2)
        return (int(pid), start) if here == self._here else None

    def check(self, rank: int):
        """Raises :class:`RankLost` when ``rank`` has exited or frozen."""
        process = self.local_process(rank)
        if process is not None and not _running(*process):
            raise RankLost(rank, "exited")
        count = self.keys.store.add(self.keys.key(f"alive/{rank}"), 0)
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or last[0] != count:
            self.seen[rank] = (count, now)
        elif now - last[1] > self.timeout_s:
            raise RankLost(rank, f"has shown no sign of life for dist_timeout "
                                 f"({self.timeout_s:g}s): frozen, hung or cut off")

    def stop(self, rank: int) -> bool:
        """Kill ``rank`` if it runs on this machine (False if not): a frozen rank must not wake
        later and take chunks, and its death ends any receive blocked on it. Only that very
        process: once it has exited, its pid may name another."""
        process = self.local_process(rank)
        if process is None:
            return False
        if _running(*process):
            try:
                os.kill(process[0], signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True


WATCH_EVERY_S = 0.5  # how often a polled wait checks that its peers live


def wait_until(ready: Callable[[], bool], watch: Callable[[], None],
               meanwhile: Callable[[], bool] = lambda: False):
    """Return once ``ready()``. Between polls ``meanwhile()`` (whether it did any work), else a
    sleep of 1 ms growing to 50 ms; every :data:`WATCH_EVERY_S` ``watch()``, which raises when
    a peer waited for is lost (within dist_timeout; this rank's own loss: its Lifeline)."""
    pause, watched = 0.001, time.monotonic()
    while not ready():
        if time.monotonic() - watched >= WATCH_EVERY_S:
            watch()
            watched = time.monotonic()
        if not meanwhile():
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
