"""One rank's part of a distributed file upscale.

Every rank: same plan, the chunks it takes as it becomes free (``taking.py``; with sequence
parallelism, its group's share dealt by ``assign_batches``), frames read from each chunk's
first batch on, models on its own device. Ranks other than 0 send each finished batch to
rank 0; rank 0 interleaves its own batches with received ones in plan order, blends them with
the same :class:`OverlapBlender` as a single process, and writes. A send is posted without
waiting and completed before the next one, so computing the next batch overlaps the transfer.
Frames travel over a gloo group of CPU tensors at the output's bit depth (``frames.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..io.background import BackgroundWriter
from ..options import OptionError, resolve_options
from ..pipeline.runner import OverlapBlender, Upscaler, to_integer_frames
from . import frames as wire
from .assign import assign_batches, owner_of
from .groups import DistContext
from .sequence import meeting_group, sequence_group, sequence_parallel
from .vae_share import SharedVaeUpscaler, vae_owners

log = logging.getLogger("seedvr2")

FAULT_ENV = "SEEDVR2_FAULT"  # test hook, "RANK:ACTION=N": see fault_point
FAULT_MARK_ENV = "SEEDVR2_FAULT_MARK"  # test hook: file where a fault writes its wall time


def _fault_spec(ctx: DistContext) -> tuple[str, int] | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    rank, _, point = spec.partition(":")
    if int(rank) != ctx.rank:
        return None
    action, _, count = point.partition("=")
    return action, int(count or 0)


def fault_point(ctx: DistContext, batches_done: int):
    """The fault hook of the multi-process tests, a no-op unless ``SEEDVR2_FAULT`` names this
    rank: ``after_batches=N`` dies without any cleanup (as a crash or ``kill -9`` would) and
    ``freeze_after_batches=N`` stops itself (as a hung driver would, SIGSTOP) once this rank
    has delivered N batches (rank 0: once it has written N), or at the end of its work if it
    delivers fewer. With ``SEEDVR2_FAULT_MARK`` the fault fires once: the mark file records
    its wall time, and a fault whose mark exists is spent."""
    spec = _fault_spec(ctx)
    if spec is None or batches_done < spec[1]:
        return
    mark = os.environ.get(FAULT_MARK_ENV)
    if mark:
        if Path(mark).exists():
            return  # fired in an earlier attempt (torchrun restarted the workers): once only
        Path(mark).write_text(repr(time.time()))
    if spec[0] == "after_batches":
        os._exit(17)
    if spec[0] == "freeze_after_batches":
        os.kill(os.getpid(), signal.SIGSTOP)


def _terminate_cleanly():
    """SIGTERM (sent by torchrun or the spawn launcher when a peer fails) becomes an exception,
    so open writers abort and remove their partial output."""
    def handler(signum, frame):
        raise SystemExit(f"terminated by signal {signum}")
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def job_digest(opts, frame_count: int, width: int, height: int, models: tuple,
               model_dir=None, source: str = "") -> str:
    """What every rank must agree on: the options that shape the result, the input (its
    size, frame count and, for files, its content digest) and the model files by content —
    a copy with one weight changed, same name and size, differs."""
    from ..loading.registry import DEFAULT_DIT, DEFAULT_VAE, resolve_model_file
    from ..pipeline.identity import model_digest

    per_rank = {"device", "dit_device", "vae_device", "devices"}
    settings = {k: v for k, v in opts.values.items() if k not in per_rank}
    identities = []
    for spec, kind, default in zip(models, ("dit", "vae"), (DEFAULT_DIT, DEFAULT_VAE)):
        if not isinstance(spec, torch.nn.Module):
            spec = resolve_model_file(spec or default, model_dir, kind, download_missing=True)
        identities.append(model_digest(spec))
    text = Path(str(opts.text_embeddings))
    if text.is_file():
        identities.append(model_digest(text))
    blob = json.dumps([settings, frame_count, width, height, identities, source], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def check_agreement(ctx: DistContext, digest: str):
    """Refuse to start when ranks disagree on options, input or model files (by content)."""
    digests = [None] * ctx.world_size
    dist.all_gather_object(digests, digest)
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise RuntimeError(f"ranks {differing} disagree with rank 0 on options, input or model "
                           f"files; every rank must run the same command on the same files")


def check_sequence_parallel(opts, ranks: int, dit=None, model_dir=None):
    """Refuse ``sequence_parallel`` that cannot split the ranks into groups or the DiT's
    attention heads over a group, from the weight file's header: before any worker starts
    (the launcher) or loads a model (torchrun)."""
    k = opts.sequence_parallel
    if k == 1:
        return
    if ranks % k:
        raise OptionError(f"sequence_parallel = {k} must divide the number of ranks "
                          f"({ranks}); use {ranks} or a divisor of it")
    if isinstance(dit, torch.nn.Module):
        heads = {block.attn.heads for block in dit.blocks}
    else:
        from ..loading.load import describe
        from ..loading.registry import DEFAULT_DIT, resolve_model_file

        heads = {describe(resolve_model_file(dit or DEFAULT_DIT, model_dir, "dit",
                                             download_missing=True))["heads"]}
    for count in heads:
        if count % k:
            raise OptionError(f"sequence_parallel = {k}: sequence parallelism over {k} ranks "
                              f"needs a head count divisible by {k}; this DiT has {count} "
                              f"heads (use a group size that divides {count})")


def _rank_options(ctx: DistContext, options: dict):
    opts = resolve_options(**options)
    if opts.dit_device != "auto" or opts.vae_device != "auto":
        log.warning("with several devices each rank runs both models on its own device; "
                    "dit_device/vae_device are ignored")
    return opts.replace(device=str(ctx.device), dit_device="auto", vae_device="auto")


def _run_share(ctx: DistContext, plan, read_from, consume, channels: int, size: tuple[int, int],
               bit_depth, dit, vae, opts, model_dir, progress, should_stop, first_chunk: int = 0):
    """Upscale this rank's batches of chunks ``first_chunk``…; the writer rank also gathers
    everyone's.

    ``read_from(first)`` gives the source frames from index ``first`` on. On the writer rank
    ``consume(outputs_from)`` finishes the job: ``outputs_from(batches)`` yields every
    rank's ``(batch, frames)`` of those (the remaining) batches in plan order; ``consume`` is
    None elsewhere. With ``sequence_parallel`` = k, consecutive groups of k ranks share each
    batch's DiT call; chunks are dealt to the groups, and each batch's VAE work is done, and its
    frames delivered, by one rank of its group (``vae_share.py``). ``bit_depth`` (8, 16, or
    None for float32 output) sets the frames' wire format.
    """
    from ..pipeline.setup import load_models, prepare_job

    k = opts.sequence_parallel
    if ctx.world_size % k:
        raise OptionError(f"sequence_parallel = {k} must divide the number of ranks "
                          f"({ctx.world_size}); use {ctx.world_size} or a divisor of it")
    timeout = datetime.timedelta(seconds=opts.dist_timeout)
    group = sequence_group(k, timeout) if k > 1 else None
    meeting = meeting_group(k)
    frames_group = wire.frame_group(timeout)  # every rank, in the same order
    _mark_started(ctx)
    if k == 1:
        _run_taken(ctx, plan, read_from, consume, channels, size, bit_depth, dit, vae, opts,
                   model_dir, progress, should_stop, frames_group, first_chunk)
        return
    shares = assign_batches(plan, ctx.world_size // k, first_chunk)
    mine = shares[ctx.rank // k]
    if ctx.is_writer and len(plan.chunks) - first_chunk < len(shares):
        log.warning("%d rank groups for %d chunks: %d group(s) stay idle", len(shares),
                    len(plan.chunks) - first_chunk, len(shares) - len(plan.chunks) + first_chunk)
    with contextlib.ExitStack() as stack:
        outputs = iter(())
        if mine:
            models = load_models(dit, vae, opts=opts, model_dir=model_dir)
            # This rank's own device against the budget, before any frame (batch_size is
            # already the one every rank uses).
            prepare_job(models, opts, plan.source_frames, size)
            stack.enter_context(sequence_parallel(models.dit, group, meeting))
            upscaler = SharedVaeUpscaler(models, opts, progress, should_stop, plan, k,
                                         ctx.rank % k, ctx.rank - ctx.rank % k, meeting)
            # Each rank delivers the batches it decoded (vae_share.py); the others it only
            # helped to compute come out without frames.
            outputs = ((b, out) for b, out in upscaler.batch_outputs(
                read_from(plan.read_start(mine)), plan, mine) if out is not None)
        if consume is not None:
            consume(lambda batches: _gather(ctx, plan, shares, k, outputs, channels, size,
                                            frames_group, batches))
        else:
            _send_all(ctx, plan, outputs, bit_depth, frames_group)


def _run_taken(ctx: DistContext, plan, read_from, consume, channels: int, size, bit_depth, dit,
               vae, opts, model_dir, progress, should_stop, frames_group, first_chunk: int):
    """Every rank takes the plan's next chunk when it is ready (``taking.py``); the writer
    receives them and hands them to ``consume`` in plan order."""
    from ..pipeline.resume import install_kill_hook
    from ..pipeline.setup import load_models, prepare_job
    from .taking import (ChunkCounter, Heartbeat, Liveness, Watchdog, chunk_outputs,
                         mark_sent, taken_in_order)

    counter = ChunkCounter(len(plan.chunks), first_chunk)
    with Heartbeat(counter, ctx.rank):
        upscaler = None

        def ready() -> Upscaler:
            nonlocal upscaler
            if upscaler is None:
                models = load_models(dit, vae, opts=opts, model_dir=model_dir)
                # This rank's own device against the budget, before any frame (batch_size is
                # already the one every rank uses).
                prepare_job(models, opts, plan.source_frames, size)
                upscaler = Upscaler(models, opts, progress, should_stop)
                if ctx.is_writer:
                    install_kill_hook(upscaler)
            return upscaler
        # Loaded before taking any chunk, unless none is left (a resumed job with every batch
        # kept, more ranks than chunks): then only if this rank must compute after all (the
        # writer, for a lost rank's batches).
        if not counter.all_taken():
            ready()

        def compute(batches: list[int]):
            return ready().batch_outputs(read_from(plan.read_start(batches)), plan, batches)
        if consume is not None:
            def in_order(batches: list[int]):
                assert batches == [b for c in plan.chunks[first_chunk:] for b in c], batches
                return taken_in_order(ctx, counter, plan, compute, channels, size,
                                      frames_group, fault_point, opts.dist_timeout)
            consume(in_order)
        else:
            liveness = Liveness(counter, opts.dist_timeout)
            _send_all(ctx, plan, chunk_outputs(ctx, counter, plan, compute), bit_depth,
                      frames_group, lambda index: mark_sent(counter, index),
                      lambda: Watchdog(liveness, 0, "waiting for the writer (rank 0)"))
            fault_point(ctx, sys.maxsize)  # a fault not reached by then: at the end of its work


def _blend_into(plan, sink, progress):
    """A writer's ``consume`` without resume: blend every batch and hand the finished frames
    to ``sink(first, frames)``."""
    def consume(outputs_from):
        blender = OverlapBlender(plan)
        for batch, out in outputs_from(list(range(len(plan.batches)))):
            for first, final in blender.add(batch, out):
                sink(first, final)
                if progress:
                    progress("frames", blender.emitted, plan.source_frames)
    return consume


def _first_chunk(ctx: DistContext, plan, state) -> int:
    """The writer's resume journal decides where every rank starts: the first chunk with a
    batch still to compute (the journal lives on the writer's disk only)."""
    first = [0]
    if state is not None:
        remaining = state.remaining_batches
        first[0] = next((i for i, c in enumerate(plan.chunks) if c[0] == remaining[0]),
                        0) if remaining else len(plan.chunks)
    if ctx.world_size > 1:
        dist.broadcast_object_list(first, src=0)
    return first[0]


STARTED_ENV = "SEEDVR2_STARTED_DIR"  # set by the spawn launcher: see _mark_started
LAUNCH_BEAT_S = 1.0


def _mark_started(ctx: DistContext):
    """Tell the spawn launcher that this rank is past the job's last collective: from here on
    the job can finish without it, so its death is not fatal (``launch.py``). The file's
    modification time then moves every :data:`LAUNCH_BEAT_S` while the process runs, so the
    launcher can tell a frozen writer from a busy one."""
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


def _mark_done(ctx: DistContext):
    """The writer tells the spawn launcher that the output is complete: what follows (leaving
    the process group, which with NCCL and a lost peer may never return) cannot lose it."""
    folder = os.environ.get(STARTED_ENV)
    if folder and ctx.is_writer:
        Path(folder, "done").touch()
    fault_point(ctx, sys.maxsize)  # the writer's fault not reached by then: after its output


def run_file_job(ctx: DistContext, src, dst, dit=None, vae=None, *, model_dir=None,
                 overwrite: bool = False, codec: str = "h264", progress=None, should_stop=None,
                 stats=None, **options) -> Path | None:
    """This rank's share of ``upscale_file``; returns the output path on rank 0.

    The writer keeps the job's resume journal (``pipeline/resume.py``) exactly as one process
    would: a killed job (a lost writer, a failed launch, torchrun restarting its workers) run
    again continues from the writer's last verified piece, with any number of ranks.
    ``stats`` (a ``JobStats``, writer rank) is told the frames and the batches reused."""
    from ..io import open_media
    from ..memory.policy import resolve_dtype
    from ..pipeline.identity import source_digest
    from ..pipeline.resume import open_resume_state, run_resumable
    from ..pipeline.setup import open_output, plan_file

    _terminate_cleanly()
    opts = _rank_options(ctx, options)
    check_sequence_parallel(opts, ctx.world_size, dit, model_dir)
    with open_media(src) as reader:
        info = reader.info
        plan, size, bit_depth = plan_file(reader, dst, opts, codec)
        check_agreement(ctx, job_digest(opts, plan.source_frames, info.width, info.height,
                                        (dit, vae), model_dir, source_digest(reader)))
        writer = state = None
        if ctx.is_writer:
            # Opened first: an existing or unwritable output fails before any work.
            writer = open_output(info, dst, size, bit_depth, codec, overwrite, opts.fps)
            try:
                # The journal names the options as given, not this rank's device.
                state = open_resume_state(reader, dst, resolve_options(**options), plan, size,
                                          bit_depth, codec, dit, vae, model_dir,
                                          resolve_dtype(opts.dtype, ctx.device))
            except BaseException:
                writer.abort()
                raise
            if state is not None:
                writer.abort()  # the kept segments become the output instead
        first_chunk = _first_chunk(ctx, plan, state)

        def read_from(first: int):
            return reader.frames(start=first)
        if not ctx.is_writer:
            _run_share(ctx, plan, read_from, None, info.channels, size, bit_depth, dit, vae,
                       opts, model_dir, progress, should_stop, first_chunk)
            return None
        if state is not None:
            result = {}

            def consume(outputs_from):
                result["path"] = None  # from here on run_resumable keeps what is complete
                result["path"] = run_resumable(
                    outputs_from, dst, plan, state, info=info, size=size, bit_depth=bit_depth,
                    codec=codec, overwrite=overwrite, progress=progress, stats=stats,
                    fps=opts.fps)
            try:
                _run_share(ctx, plan, read_from, consume, info.channels, size, bit_depth, dit,
                           vae, opts, model_dir, progress, should_stop, first_chunk)
            except BaseException:
                if "path" not in result:  # failed before writing began (loading the models)
                    state.keep_or_discard(len(plan.batches))
                raise
            _mark_done(ctx)
            return result["path"]
        # The writer aborts (removing its partial file) on any exception, SIGTERM included;
        # it encodes on a thread while this rank computes and receives.
        with BackgroundWriter(writer) as output:
            sink = lambda first, final: output.write_many(to_integer_frames(final, bit_depth))
            _run_share(ctx, plan, read_from, _blend_into(plan, sink, progress), info.channels,
                       size, bit_depth, dit, vae, opts, model_dir, progress, should_stop)
        if stats is not None:
            stats.frames = plan.source_frames
        _mark_done(ctx)
        return Path(writer.path)


def run_tensor_job(ctx: DistContext, frames: torch.Tensor, out: torch.Tensor, dit=None, vae=None,
                   *, model_dir=None, progress=None, should_stop=None, **options) -> None:
    """This rank's share of ``upscale`` on frames in (shared) memory; the writer rank fills
    ``out`` (T, H', W', C) float32 with the finished frames."""
    from ..pipeline.plan import make_plan

    _terminate_cleanly()
    opts = _rank_options(ctx, options)
    plan = make_plan(len(frames), opts)
    check_agreement(ctx, job_digest(opts, len(frames), frames.shape[2], frames.shape[1],
                                    (dit, vae), model_dir))

    def fill(first: int, final: torch.Tensor):
        out[first: first + len(final)] = final
    _run_share(ctx, plan, lambda first: iter(frames[first:]),
               _blend_into(plan, fill, progress) if ctx.is_writer else None,
               out.shape[-1], tuple(out.shape[1:3]), None, dit, vae, opts, model_dir, progress,
               should_stop)
    _mark_done(ctx)


def _send_all(ctx: DistContext, plan, outputs, bit_depth, group, posted=None, guard=None):
    """Send each finished batch to the writer, one message in flight. ``posted(batch)`` is
    told when a message is posted; ``guard()`` is a context around each wait for the writer
    (a watchdog on its heartbeat)."""
    fault = _fault_spec(ctx)
    pending = None  # (works, message): the message must live until its sends complete

    def complete():
        with guard() if guard is not None else contextlib.nullcontext():
            for work in pending[0]:
                work.wait()
    for sent, (batch, out) in enumerate(outputs, start=1):
        message = wire.encode_batch(out, wire.quantized_span(plan, batch), bit_depth)
        if pending is not None:
            complete()
        pending = (wire.send_batch(message, 0, batch.index, group), message)
        if posted is not None:
            posted(batch.index)
        if fault is not None and sent >= fault[1]:
            complete()
            fault_point(ctx, sent)
    if pending is not None:
        complete()


def _gather(ctx, plan, shares, group_size, local_outputs, channels, size, group, batches):
    """The writer's side with sequence parallelism: ``(batch, frames)`` of ``batches`` in plan
    order, those it decoded itself computed here, the others received from the rank of their
    group that decoded them."""
    decoder = vae_owners(plan, group_size)
    owner = {b: group * group_size + decoder[b] for b, group in owner_of(shares).items()}
    local = iter(local_outputs)
    for written, index in enumerate(batches):
        b = plan.batches[index]
        fault_point(ctx, written)
        if owner[b.index] == ctx.rank:
            batch, out = next(local)
            assert batch.index == b.index
        else:
            try:
                out = wire.recv_batch(owner[b.index], b.index, (b.frames, *size, channels), group)
            except Exception as e:
                raise RuntimeError(f"rank {owner[b.index]} did not deliver batch {b.index} "
                                   f"(frames {b.start}-{b.stop - 1}): it failed or timed out "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                                   ) from e
        yield b, out
