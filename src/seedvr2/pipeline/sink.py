"""Where a file job's batches go: written directly, or through the resume journal's pieces. One
process and the writer rank of several open the same sink (:func:`open_sink`) and hand it their
producer: ``sink.consume(outputs_from)``, ``outputs_from(batches)`` yielding ``(batch, frames)``
for those plan batches in order."""

from __future__ import annotations

from pathlib import Path

from ..io.background import BackgroundWriter
from .resume import open_resume_state, run_resumable
from .runner import final_frames, to_integer_frames


class DirectSink:
    """Every batch blended and encoded on a thread (a bounded queue) while the device computes
    on; the writer aborts, removing its partial file, on any exception."""

    def __init__(self, writer, plan, bit_depth: int):
        self.writer, self.plan, self.bit_depth = writer, plan, bit_depth
        self.remaining_batches = list(range(len(plan.batches)))
        self._output = BackgroundWriter(writer)

    def __enter__(self):
        self._output.__enter__()
        return self

    def __exit__(self, *exc):
        return self._output.__exit__(*exc)

    def consume(self, outputs_from, progress=None, stats=None, check_stop=None,
                preview=None) -> Path:
        for _, frame in final_frames(self.plan, outputs_from(self.remaining_batches), progress,
                                     stats, check_stop, preview):
            self._output.write_many(to_integer_frames(frame, self.bit_depth))
        return Path(self.writer.path)


class ResumableSink:
    """The output written through closed, verified pieces (``resume.py``); a job that fails
    before its first batch keeps what an earlier run left, or leaves nothing."""

    def __init__(self, state, info, output):
        self.state, self.info, self.output = state, info, output
        self.remaining_batches = state.remaining_batches
        self._started = False

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        if kind is not None and not self._started:  # failed before writing began
            self.state.keep_or_discard(len(self.state.plan.batches))

    def consume(self, outputs_from, progress=None, stats=None, check_stop=None,
                preview=None) -> Path:
        self._started = True  # from here on run_resumable keeps what is complete
        return run_resumable(outputs_from, self.state, self.info, self.output, progress, stats,
                             preview)


def open_sink(writer, reader, output, plan, identity: dict, compute_dtype, job):
    """The sink of a file job whose ``writer`` is open (so a bad output failed before any
    work): the resume state when the job keeps one (the writer is then discarded), else it."""
    try:
        state = open_resume_state(reader, output, plan, identity, compute_dtype,
                                  fresh=not job.opts.resume, faults=job.faults)
    except BaseException:
        writer.abort()
        raise
    if state is None:
        return DirectSink(writer, plan, output.bit_depth)
    writer.abort()
    return ResumableSink(state, reader.info, output)
