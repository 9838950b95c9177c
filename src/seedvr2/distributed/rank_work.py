"""One rank's part of a distributed file upscale: the same plan on every rank, the chunks it
takes (``taking.py``) or its sequence-parallel group is dealt, sent to rank 0, which blends
them in plan order with the same :class:`OverlapBlender` as one process and writes. A send is
posted without waiting and completed before the next, so the next batch's compute overlaps it."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..io import open_media
from ..memory.device_choice import resolve_dtype
from ..options import OptionError
from ..pipeline.identity import identity_digest, job_identity, source_digest
from ..pipeline.job import Job, plan_file
from ..pipeline.plan import BatchPlan, make_plan
from ..pipeline.runner import final_frames
from ..pipeline.sink import open_sink
from . import frames as wire
from .groups import DistContext, group_timeout
from .peers import DistributedError, JobKeys, Lifeline, Liveness, RankLost
from .sequence import Meeting, heads_problem, meeting_group, sequence_group, sequence_parallel
from .taking import ChunkCollector, ChunkCounter, assign_batches, chunk_outputs
from .vae_share import SharedVaeUpscaler, vae_owners

log = logging.getLogger("seedvr2")


def _terminate_cleanly():
    """SIGTERM (sent by torchrun or the spawn launcher when a peer fails) becomes an exception,
    so open writers abort and remove their partial output."""
    def handler(signum, frame):
        raise SystemExit(f"terminated by signal {signum}")
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def check_agreement(ctx: DistContext, identity: dict):
    """Refuse to start when ranks disagree on the job's identity (:func:`job_identity`)."""
    digests = ctx.gather(identity_digest(identity))
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise DistributedError(f"ranks {differing} disagree with rank 0 on options, input or model "
                               f"files; every rank must run the same command on the same files")


def check_sequence_parallel(job: Job, ranks: int):
    """Refuse a ``sequence_parallel`` that cannot split the ranks or the DiT's heads (from the
    weight file's header), before any worker starts or loads a model."""
    k = job.opts.sequence_parallel
    if k == 1:
        return
    if ranks % k:
        raise OptionError(f"sequence_parallel = {k} must divide the number of ranks "
                          f"({ranks}); use {ranks} or a divisor of it")
    dit = job.resolved().models[0]
    if dit.loaded:
        heads = {block.attn.heads for block in dit.model.blocks}
    else:
        from ..loading.load import describe

        heads = {describe(dit.model)["heads"]}
    for count in heads:
        if problem := heads_problem(count, k):
            raise OptionError(f"sequence_parallel = {k}: {problem}")


def _on_rank(ctx: DistContext, job: Job) -> Job:
    """The job as this rank runs it: its models resolved, both on the rank's own device."""
    job, opts = job.resolved(), job.opts
    if opts.dit_device != "auto" or opts.vae_device != "auto":
        log.warning("with several devices each rank runs both models on its own device; "
                    "dit_device/vae_device are ignored")
    return job.with_options(opts.replace(device=str(ctx.device), dit_device="auto",
                                         vae_device="auto"))


@dataclass
class RankWork:
    """One rank's part of a job: ``read_from(first)`` gives the source frames from ``first``
    on; its output frames are (H, W, C) and travel at ``bit_depth`` 8, 16, or None (float32)."""

    ctx: DistContext
    job: Job
    plan: BatchPlan
    read_from: Callable[[int], Iterable]
    frame_shape: tuple[int, int, int]
    bit_depth: Optional[int]
    progress: Optional[Callable] = None
    should_stop: Optional[Callable[[], bool]] = None
    first_chunk: int = 0  # chunks before it are kept by the writer's resume journal

    def compute(self, upscaler, batches: list[int]):
        return upscaler.batch_outputs(self.read_from(self.plan.read_start(batches)), self.plan,
                                      batches)


@dataclass(frozen=True)
class Links:
    """What one rank's job talks over, made by every rank in the same order: gloo groups with
    the job's ``dist_timeout`` (longer waits are polled in the store: ``Handover``,
    ``Meeting``), NCCL ones with ``group_timeout``'s, its keys, its view of the other ranks,
    and its sequence group and meeting (None without sequence parallelism)."""

    frames_group: object
    keys: JobKeys
    liveness: Liveness
    handover: wire.Handover
    sequence_group: object = None
    meeting: Optional[Meeting] = None

    @classmethod
    def make(cls, ctx: DistContext, opts) -> "Links":
        k, timeout = opts.sequence_parallel, datetime.timedelta(seconds=opts.dist_timeout)
        group = sequence_group(k, group_timeout(dist.get_backend(), opts.dist_timeout)) \
            if k > 1 else None
        meeting = meeting_group(k, timeout)
        frames = wire.frame_group(timeout)  # every rank, in the same order
        keys = JobKeys()
        liveness = Liveness(keys, opts.dist_timeout)
        first = ctx.rank - ctx.rank % k
        return cls(frames, keys, liveness, wire.Handover(keys, liveness), group,
                   Meeting(meeting, list(range(first, first + k)), ctx.rank, keys, liveness)
                   if k > 1 else None)


class TakenChunks:
    """Ranks take the next chunk when ready (``taking.py``); the writer yields all in plan order."""

    def __init__(self, work: RankWork, links: Links):
        self.work, self.links = work, links
        self.counter = ChunkCounter(links.keys, len(work.plan.chunks), work.first_chunk)
        self.upscaler = None

    def __enter__(self):
        # Loaded before taking a chunk; if none is left, only for a lost rank's batches.
        if not self.counter.all_taken():
            self._ready()
        return self

    def __exit__(self, *exc):
        pass

    def _ready(self):
        if self.upscaler is None:
            work = self.work
            progress = work.progress
            if work.ctx.is_writer:
                progress = work.job.faults.with_kill_points(progress)
            # This rank's device against the budget, keeping every rank's batch_size.
            self.upscaler = work.job.ready_upscaler(work.plan.source_frames, work.frame_shape[:2],
                                                    fixed_batch=True, progress=progress,
                                                    should_stop=work.should_stop)
        return self.upscaler

    def _compute(self, batches: list[int]):
        return self.work.compute(self._ready(), batches)

    def outputs(self, batches: list[int]):
        plan = self.work.plan
        assert batches == [b for c in plan.chunks[self.work.first_chunk:] for b in c], batches
        return ChunkCollector(self.work, self.links, self.counter, self._compute).outputs()

    def send_all(self):
        work = self.work
        _send_all(work, self.links, chunk_outputs(work.ctx.rank, self.counter, work.plan,
                                                  self._compute, work.job.faults))
        # A fault not reached by then: at the end of its work.
        work.job.faults.fault_point(work.ctx.rank, sys.maxsize)


class SharedBatches:
    """Groups of ``sequence_parallel`` consecutive ranks share each batch's DiT call; chunks go to
    the groups, one rank of which does a batch's VAE work and delivers it (``vae_share.py``)."""

    def __init__(self, work: RankWork, links: Links):
        ctx, plan, k = work.ctx, work.plan, work.job.opts.sequence_parallel
        self.work, self.links, self.k = work, links, k
        self.shares = assign_batches(plan, ctx.world_size // k, work.first_chunk)
        self.mine = self.shares[ctx.rank // k]
        idle = len(self.shares) - len(plan.chunks) + work.first_chunk
        if ctx.is_writer and idle > 0:
            log.warning("%d rank groups for %d chunks: %d group(s) stay idle", len(self.shares),
                        len(plan.chunks) - work.first_chunk, idle)
        self.stack = contextlib.ExitStack()
        self.local = iter(())

    def __enter__(self):
        work = self.work
        if self.mine:
            upscaler = work.job.ready_upscaler(
                work.plan.source_frames, work.frame_shape[:2], build=SharedVaeUpscaler,
                fixed_batch=True, progress=work.progress, should_stop=work.should_stop,
                owners=vae_owners(work.plan, self.k),
                seat=(work.ctx.rank % self.k, work.ctx.rank - work.ctx.rank % self.k),
                meeting=self.links.meeting)
            self.stack.enter_context(sequence_parallel(upscaler.models.dit,
                                                       self.links.sequence_group,
                                                       self.links.meeting))
            # Each rank delivers the batches it decoded (vae_share.py); others come out frameless.
            self.local = ((b, out) for b, out in work.compute(upscaler, self.mine)
                          if out is not None)
        return self

    def __exit__(self, *exc):
        self.stack.close()

    def outputs(self, batches: list[int]):
        """The writer's side: ``(batch, frames)`` of ``batches`` in plan order, computed here or
        received from the rank that decoded them."""
        work, k = self.work, self.k
        plan, local = work.plan, iter(self.local)
        decoder = vae_owners(plan, k)
        owner = {b: group * k + decoder[b] for group, share in enumerate(self.shares)
                 for b in share}
        for written, index in enumerate(batches):
            b = plan.batches[index]
            work.job.faults.fault_point(work.ctx.rank, written)
            if owner[b.index] == work.ctx.rank:
                batch, out = next(local)
                assert batch.index == b.index
            else:
                out = _received(work, self.links, owner[b.index], b)
            yield b, out

    def send_all(self):
        _send_all(self.work, self.links, self.local)


def _received(work: RankWork, links: Links, rank: int, b):
    try:
        links.handover.wait_posted(b.index, rank)
        links.handover.receiving(b.index)
        return wire.recv_batch(rank, b.index, (b.frames, *work.frame_shape), links.frames_group)
    except Exception as e:
        raise DistributedError(f"rank {rank} did not deliver batch {b.index} "
                               f"(frames {b.start}-{b.stop - 1}): it failed or timed out "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                               ) from e


def _produce(work: RankWork, consume=None):
    """Upscale this rank's batches of chunks ``work.first_chunk``…. The writer returns
    ``consume(outputs_from)``, ``outputs_from(batches)`` yielding every rank's ``(batch,
    frames)`` in plan order; the others (``consume`` None) send theirs to the writer. The
    rank's ``Lifeline`` ends it should it be cut off from the job."""
    ctx, opts = work.ctx, work.job.opts
    check_sequence_parallel(work.job, ctx.world_size)
    links = Links.make(ctx, opts)
    _mark_started(ctx)
    with Lifeline(links.keys, ctx.rank, opts.dist_timeout), \
            (TakenChunks(work, links) if opts.sequence_parallel == 1
             else SharedBatches(work, links)) as producer:
        if consume is None:
            return producer.send_all()
        return consume(producer.outputs)


def _first_chunk(ctx: DistContext, plan, remaining: Optional[list[int]]) -> int:
    """The first chunk with a batch to compute, from the writer's resume journal (its disk only)."""
    first = [0]
    if remaining is not None:
        first[0] = next((i for i, c in enumerate(plan.chunks) if c[0] == remaining[0]),
                        0) if remaining else len(plan.chunks)
    if ctx.world_size > 1:
        dist.broadcast_object_list(first, src=0)
    return first[0]


STARTED_ENV = "SEEDVR2_STARTED_DIR"  # set by the spawn launcher: see _mark_started
LAUNCH_BEAT_S = 1.0


def _mark_started(ctx: DistContext):
    """Tell the spawn launcher that this rank is past the job's last collective, so its death
    is no longer fatal (``launch.py``); the mark's mtime then moves every
    :data:`LAUNCH_BEAT_S`, so the launcher tells a frozen writer from a busy one."""
    folder = os.environ.get(STARTED_ENV)
    if not folder:
        return
    mark = Path(folder, f"rank{ctx.rank}")
    mark.touch()

    def beat():
        while True:
            time.sleep(LAUNCH_BEAT_S)
            try:
                os.utime(mark)
            except OSError:  # the launcher removed its folder: the job is over
                return
    threading.Thread(target=beat, name="seedvr2-launch-beat", daemon=True).start()


def _mark_done(ctx: DistContext, job: Job):
    """The writer tells the spawn launcher that the output is complete: leaving the group
    (with NCCL and a lost peer perhaps never) cannot lose it."""
    folder = os.environ.get(STARTED_ENV)
    if folder and ctx.is_writer:
        Path(folder, "done").touch()
    job.faults.fault_point(ctx.rank, sys.maxsize)  # the writer's not reached: after its output


def run_file_job(ctx: DistContext, job: Job, src, output, progress=None, should_stop=None,
                 stats=None) -> Path | None:
    """This rank's share of ``upscale_file``; returns the output path on rank 0, which keeps
    the resume journal as one process would (docs/resume.md) and tells ``stats``."""
    _terminate_cleanly()
    job = _on_rank(ctx, job)
    with open_media(src) as reader:
        plan = plan_file(reader, job.opts)
        identity = job_identity(job.opts, source_digest(reader), job.models)
        check_agreement(ctx, identity)
        work = RankWork(ctx, job, plan, lambda first: reader.frames(start=first),
                        (*output.size, reader.info.channels), output.bit_depth, progress,
                        should_stop)
        if not ctx.is_writer:
            work.first_chunk = _first_chunk(ctx, plan, None)
            return _produce(work)
        with open_sink(output.open(reader.info), reader, output, plan, identity,
                       resolve_dtype(job.opts.dtype, ctx.device), job) as sink:
            work.first_chunk = _first_chunk(ctx, plan, sink.remaining_batches)
            path = _produce(work, lambda outputs_from: sink.consume(
                outputs_from, progress, stats, preview=job.preview))
    _mark_done(ctx, job)
    return path


def run_tensor_job(ctx: DistContext, job: Job, frames: torch.Tensor, out: torch.Tensor,
                   progress=None, should_stop=None) -> None:
    """This rank's share of ``upscale`` on frames in (shared) memory; the writer rank fills
    ``out`` (T, H', W', C) float32 with the finished frames."""
    _terminate_cleanly()
    job = _on_rank(ctx, job)
    plan = make_plan(len(frames), job.opts)
    check_agreement(ctx, job_identity(job.opts, "frames " + "x".join(map(str, frames.shape)),
                                      job.models))

    def fill(outputs_from):
        for first, final in final_frames(plan, outputs_from(list(range(len(plan.batches)))),
                                         progress, preview=job.preview):
            out[first: first + len(final)] = final
    _produce(RankWork(ctx, job, plan, lambda first: iter(frames[first:]), tuple(out.shape[1:]),
                      None, progress, should_stop), fill if ctx.is_writer else None)
    _mark_done(ctx, job)


def _send_all(work: RankWork, links: Links, outputs):
    """Send each finished batch to the writer, one message in flight: posted, and completed
    (``links.handover``) after the next batch is computed."""
    rank, faults = work.ctx.rank, work.job.faults
    fault_after = faults.rank_fault_after(rank)
    pending = None  # (batch index, works, message): the message must live until it is sent

    def complete():
        index, works, _ = pending
        try:
            links.handover.wait_receiving(index)
        except RankLost as e:
            raise RankLost(e.rank, f"(the writer) {e.reason}; rank {rank} cannot deliver batch "
                                   f"{index}") from None
        for sending in works:
            sending.wait()
    for sent, (batch, out) in enumerate(outputs, start=1):
        message = wire.encode_batch(out, wire.quantized_span(work.plan, batch), work.bit_depth)
        if pending is not None:
            complete()
        pending = (batch.index, wire.send_batch(message, 0, batch.index, links.frames_group),
                   message)
        links.handover.posted(batch.index)
        if fault_after is not None and sent >= fault_after:
            complete()
            pending = None
            faults.fault_point(rank, sent)
    if pending is not None:
        complete()
