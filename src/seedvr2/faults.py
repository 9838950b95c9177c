"""Fault injection for the tests, in one place: kills, freezes and slow ranks at named points.

The multi-process and resume tests need a job to die (or hang, or lag) at an exact instant,
and short clips cut into several resume segments. They say so through environment variables,
read only by :meth:`Faults.from_environment`, which the facade calls once per job and hands
down (spawned workers receive it pickled). ``Faults()``, the default below the facade,
injects nothing.

* ``SEEDVR2_KILL_AT=POINT:N``: SIGKILL at the N-th POINT (``encode``/``dit``/``decode``: that
  batch's phase is done; ``write``: a segment has frames in it; ``segment``: a segment is
  closed but the journal does not name it yet; ``journal``: the journal names it; ``part``:
  the journal names the N-th part).
* ``SEEDVR2_KILL_IN_ASSEMBLY=N``: SIGKILL once the final video holds N segments.
* ``SEEDVR2_SEGMENT_FRAMES`` / ``SEEDVR2_CHECKPOINT_SECONDS``: smaller resume segments, and a
  part at every chunk's end (0).
* ``SEEDVR2_FAULT=RANK:ACTION=N``: that rank dies (``after_batches``) or freezes
  (``freeze_after_batches``) once it has delivered N batches; with ``SEEDVR2_FAULT_MARK=FILE``
  only once (the file records the fault's wall time). ``cut_off_after_batches`` (needs the
  mark) stands still there until the test has cut its node off the network, which the test
  says by creating ``FILE.cut`` (at most :data:`CUT_OFF_WAIT_S`), then carries on: the rank
  meets its lost job in whatever it does next.
* ``SEEDVR2_SLOW=RANK:SECONDS``: that rank sleeps this long per batch.
* ``SEEDVR2_TEST_HOLD_UNTIL_INTERRUPT=PATH``: while a file exists there, the next node run
  removes it, writes ``PATH.waiting`` and waits until it is interrupted, so a ComfyUI test
  interrupts a run at a known point instead of racing it.
* ``SEEDVR2_TEST_CACHE_STATE=PATH``: the kinds of model in our cache and in ComfyUI's list are
  written to that JSON file whenever they change.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional


CUT_OFF_WAIT_S = 60.0  # how long a rank waits for the test to cut it off


@dataclass(frozen=True)
class Faults:
    kill_at: str = ""
    kill_in_assembly: int = 0
    segment_frames: Optional[int] = None
    checkpoint_seconds: Optional[float] = None
    rank_fault: str = ""
    fault_mark: str = ""
    slow: str = ""
    hold_until_interrupt: str = ""
    cache_state: str = ""

    @classmethod
    def from_environment(cls) -> "Faults":
        env = os.environ.get
        frames, seconds = env("SEEDVR2_SEGMENT_FRAMES"), env("SEEDVR2_CHECKPOINT_SECONDS")
        return cls(env("SEEDVR2_KILL_AT", ""), int(env("SEEDVR2_KILL_IN_ASSEMBLY") or 0),
                   int(frames) if frames else None, float(seconds) if seconds else None,
                   env("SEEDVR2_FAULT", ""), env("SEEDVR2_FAULT_MARK", ""),
                   env("SEEDVR2_SLOW", ""), env("SEEDVR2_TEST_HOLD_UNTIL_INTERRUPT", ""),
                   env("SEEDVR2_TEST_CACHE_STATE", ""))

    def hold_until_interrupted(self, interrupted: Callable[[], bool]):
        """If the hold file exists, consume it, say so in ``<file>.waiting`` and wait (at most
        5 minutes) until ``interrupted()``."""
        request = Path(self.hold_until_interrupt)
        try:
            request.unlink()
        except FileNotFoundError:
            return
        request.with_name(request.name + ".waiting").write_text("waiting for an interrupt\n")
        deadline = time.monotonic() + 300
        while not interrupted() and time.monotonic() < deadline:
            time.sleep(0.05)

    def record_cache_state(self, state: dict):
        """``state`` to the cache-state file (renamed into place: never half written)."""
        if self.cache_state:
            tmp = Path(self.cache_state + ".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.cache_state)

    def kill_point(self, point: str, count: int):
        """SIGKILL this process at the ``count``-th ``point`` when the tests ask for it."""
        if self.kill_at and self.kill_at == f"{point}:{count}":
            os.kill(os.getpid(), signal.SIGKILL)

    def with_kill_points(self, progress: Optional[Callable[[str, int, int], None]]):
        """``progress`` (None: none) that first reaches the kill point of each phase step."""
        if not self.kill_at:
            return progress

        def report(phase: str, done: int, total: int):
            self.kill_point(phase, done)
            if progress is not None:
                progress(phase, done, total)
        return report

    def assembled(self, segments: int):
        """The final video holds ``segments`` segments."""
        if self.kill_in_assembly == segments:
            os.kill(os.getpid(), signal.SIGKILL)

    def rank_fault_after(self, rank: int) -> Optional[int]:
        """Batches after which ``rank``'s fault fires; None when it has none."""
        target, _, point = self.rank_fault.partition(":")
        if not self.rank_fault or int(target) != rank:
            return None
        return int(point.partition("=")[2] or 0)

    def fault_point(self, rank: int, batches_done: int):
        """``rank`` has delivered (the writer: written) ``batches_done`` batches: its fault
        fires at its count (dies without cleanup as a crash would, or stops as a hung driver)."""
        after = self.rank_fault_after(rank)
        if after is None or batches_done < after:
            return
        if self.fault_mark:
            if Path(self.fault_mark).exists():
                return  # fired in an earlier attempt (torchrun restarted the workers): once only
            Path(self.fault_mark).write_text(repr(time.time()))
        action = self.rank_fault.partition(":")[2].partition("=")[0]
        if action == "after_batches":
            os._exit(17)
        if action == "freeze_after_batches":
            os.kill(os.getpid(), signal.SIGSTOP)
        if action == "cut_off_after_batches":
            cut = Path(self.fault_mark + ".cut")
            deadline = time.monotonic() + CUT_OFF_WAIT_S
            while not cut.exists() and time.monotonic() < deadline:
                time.sleep(0.02)

    def slowness(self, rank: int) -> float:
        target, _, seconds = self.slow.partition(":")
        return float(seconds) if self.slow and target == str(rank) else 0.0


NO_FAULTS = Faults()
