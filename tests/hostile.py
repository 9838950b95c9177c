"""Helpers of the property-based hostile tests (Hypothesis; profiles in conftest.py).

Every surface where outside data enters has its own strategy in its own test file; they share
one invariant, checked here: **a correct result, or one clean error of ours that names the
thing at fault** (a :class:`seedvr2.errors.SeedVR2Error`, or on the command line one ``error:``
line and a non-zero status); never another exception, a traceback, a hang past a stated bound,
an abort, or a wrong result with exit status 0. What "correct" means is the calling test's
business: these helpers only sort the outcome.
"""

from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from seedvr2.errors import SeedVR2Error


@dataclass
class Outcome:
    """What a call did: returned ``value``, or refused with ``error`` (one of ours)."""

    value: Any = None
    error: Optional[SeedVR2Error] = None

    @property
    def refused(self) -> bool:
        return self.error is not None

    @property
    def message(self) -> str:
        return str(self.error) if self.error is not None else ""


def outcome(call: Callable[[], Any], *names: str) -> Outcome:
    """Run ``call()``. A returned value, or a :class:`SeedVR2Error` whose message contains every
    one of ``names`` (the file, node, option or frame at fault), is an :class:`Outcome`; any
    other exception propagates, so Hypothesis reports and shrinks it as the defect it is."""
    try:
        return Outcome(value=call())
    except SeedVR2Error as e:
        message = str(e)
        missing = [name for name in names if name not in message]
        assert not missing, f"the error does not name {missing}: {message!r}"
        assert message.strip(), f"{type(e).__name__} with an empty message"
        return Outcome(error=e)


@dataclass
class CliRun:
    status: int
    stdout: str
    stderr: str


def run_cli(argv: list[str]) -> CliRun:
    """``seedvr2 ARGV`` in this process, its output captured. The invariant of the command
    line: status 0, or a non-zero status with a message and no traceback; argparse's own
    refusals (status 2) count as clean."""
    from seedvr2.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's refusals and --help
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    run = CliRun(int(status or 0), out.getvalue(), err.getvalue())
    assert "Traceback" not in run.stderr, run.stderr
    if run.status != 0:
        assert run.stderr.strip(), f"status {run.status} without a message"
    return run


# A bound on a call's time: bench/gpu_checks.py's alarm (SIGALRM, the main thread, where pytest
# runs tests; it raises SectionTimeout, a BaseException no ``except Exception`` of ours hides).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_checks import SectionTimeout, time_cap  # noqa: E402


def outcome_within(seconds: float, call: Callable[[], Any], *names: str) -> Outcome:
    """:func:`outcome`, failing (an AssertionError, which Hypothesis shrinks and reports with
    its example) when the call runs past ``seconds``."""
    try:
        with time_cap(seconds):
            return outcome(call, *names)
    except SectionTimeout:
        raise AssertionError(f"no answer within {seconds} s") from None
