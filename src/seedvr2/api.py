"""The facade every interface calls: ``upscale`` (frames in memory) and ``upscale_file``.

A job is built once (``seedvr2.pipeline.job.Job``) and run in this process or over several
ranks (``seedvr2.distributed``: spawned here, or this process is one rank of a torchrun/Slurm
launch); either way ``Job.prepare`` checks the memory budget and loads the models before any
frame, and a file job writes through ``seedvr2.pipeline.sink``. See docs/architecture.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from .errors import InputError, UsageError
from .faults import Faults
from .options import OptionError, Options, option_ref, option_value, resolve_options
from .io import open_media
from .io.files import frame_count
from .pipeline.cuts import resolve_scene_cuts
from .pipeline.identity import job_identity, source_digest
from .pipeline.plan import make_plan
from .pipeline.preview import FramePreview, Show
from .pipeline.runner import JobStats, Upscaler, input_frames, output_size
from .pipeline.sink import DirectSink, open_sink
from .pipeline.work import log_work
from .memory.fit import MEMORY_CHECK_ENV, MakeRoom
from .pipeline.job import (Job, check_file_job, file_output, fit_for_ranks, plan_file,
                           prepare_job)
from .pipeline.model_loading import load_models

# The set-up steps are the library's too (custom pipelines, the CLI, tests).
__all__ = ["MEMORY_CHECK_ENV", "check_file_job", "fit_for_ranks", "load_models",
           "plan_file", "prepare_job", "process_devices", "upscale", "upscale_file"]

Progress = Callable[[str, int, int], None]


def process_devices(opts: Options, dit, vae) -> tuple[list[str], Options]:
    """The devices to run on, one process each, and the options of a single process.
    ``devices=auto`` spreads over every visible GPU unless something ties the job to one: an
    explicit ``device``, ``dit_device`` or ``vae_device``, or models given loaded (modules
    cannot travel to workers). A device list given explicitly is obeyed as it is."""
    from .distributed.launch import parse_devices

    if opts.devices == "auto":
        chosen = [getattr(opts, name) for name in ("device", "dit_device", "vae_device")]
        if any(d != "auto" for d in chosen):
            return [next(d for d in chosen if d != "auto")], opts
        firsts = [next(m.parameters(), None) for m in (dit, vae) if isinstance(m, torch.nn.Module)]
        on_gpu = [p.device for p in firsts if p is not None and p.device.type == "cuda"]
        if on_gpu:
            return [str(on_gpu[0])], opts.replace(device=str(on_gpu[0]))
        if isinstance(dit, torch.nn.Module) or isinstance(vae, torch.nn.Module):
            return [opts.device], opts  # on the CPU: auto places them on the current GPU
    devices = parse_devices(opts.devices)
    if len(devices) == 1 and opts.device == "auto" and opts.devices != "auto":
        opts = opts.replace(device=devices[0])
    return devices, opts


def upscale(frames, dit=None, vae=None, *, model_dir=None, progress: Optional[Progress] = None,
            should_stop: Optional[Callable[[], bool]] = None, stats: Optional[JobStats] = None,
            make_room: Optional[MakeRoom] = None, preview: Optional[Show] = None,
            opts: Optional[Options] = None, **options) -> torch.Tensor:
    """Upscale frames in memory: ComfyUI's IMAGE convention in and out.

    ``frames``: float (T, H, W, C) in [0, 1] (or uint8/uint16), C = 1, 3 or 4; a single (H, W, C)
    image is one frame. Returns float32 (T, H', W', C) in [0, 1] on the CPU. ``stats`` (a
    ``JobStats``) records the job as it runs. ``make_room(device, bytes)``, where a host holds
    memory it frees on demand (ComfyUI), is asked for what the job needs before the memory budget
    measures a device (one process only). ``preview(thumbnail)`` is shown the newest finished
    frame about once a second (:mod:`seedvr2.pipeline.preview`). ``opts``: options already
    resolved (a node's, the CLI's), instead of ``**options``."""
    opts = _options("upscale", opts, options)
    frames = input_frames(frames)
    opts = _scene_cuts(opts, len(frames), lambda: iter(frames), stats)
    devices, opts = process_devices(opts, dit, vae)
    job = _job(opts, devices, (dit, vae), model_dir, make_room=make_room, preview=preview)
    size = output_size(frames.shape[1], frames.shape[2], opts)
    if len(devices) > 1:
        from .distributed.launch import spawn_tensor_job

        job = fit_for_ranks(job, devices, len(frames), size)
        return spawn_tensor_job(devices, job, frames, (len(frames), *size, frames.shape[3]),
                                progress, should_stop, preview)
    upscaler = job.ready_upscaler(len(frames), size, progress=progress,
                                  should_stop=should_stop, stats=stats)
    plan = make_plan(len(frames), upscaler.opts)
    log_work(upscaler.models, plan, upscaler.opts, size)
    return torch.cat([out for _, out in upscaler.run(iter(frames), plan, job.preview)])


def _job(opts: Options, devices: list[str], models: tuple, model_dir, spawned: bool = True,
         make_room: Optional[MakeRoom] = None, preview: Optional[Show] = None) -> Job:
    """The job, after the checks that need no model file (spawned ranks need models by name
    or path; several ranks a ``sequence_parallel`` they can split). Only one process asks
    ``make_room``; the process that blends the frames shows ``preview``."""
    shown = FramePreview(preview) if preview is not None else None
    if len(devices) == 1:
        if opts.sequence_parallel > 1:
            raise OptionError(f"{option_value('sequence_parallel', opts.sequence_parallel)} needs "
                              f"as many ranks: list the devices "
                              f"({option_ref('devices', 'cuda:0,cuda:1')}) or launch with torchrun")
        return Job.build(opts, *models, model_dir, Faults.from_environment(), make_room, shown)
    from .distributed.rank_work import check_sequence_parallel

    if spawned and any(isinstance(m, torch.nn.Module) for m in models):
        raise InputError("several devices need the models by name or path (each worker "
                         "loads its own), not loaded modules")
    job = Job.build(opts, *models, model_dir, Faults.from_environment(),
                    preview=None if spawned else shown)
    check_sequence_parallel(job, len(devices))
    return job


def upscale_file(src, dst, dit=None, vae=None, *, model_dir=None, overwrite: bool = False,
                 codec: str = "h264", progress: Optional[Progress] = None,
                 should_stop: Optional[Callable[[], bool]] = None,
                 stats: Optional[JobStats] = None, make_room: Optional[MakeRoom] = None,
                 preview: Optional[Show] = None, opts: Optional[Options] = None,
                 **options) -> Path:
    """Upscale a video, image or image sequence file to ``dst``, streaming frame by frame.

    Video keeps its exact frame rate (variable-rate video: every frame's time) and its audio
    and subtitles where the output holds them (copied, not re-encoded); ``fps`` gives images
    and sequences a rate for a video output. The output appears at ``dst`` only when complete;
    an existing ``dst`` is replaced only with ``overwrite=True``. The other keywords as in
    :func:`upscale`. Returns the output path.
    """
    from .distributed import in_distributed_launch, init_from_env
    from .distributed.rank_work import run_file_job
    from .distributed.launch import spawn_file_job

    opts = _options("upscale_file", opts, options)
    if in_distributed_launch():  # torchrun / Slurm: this process is one rank
        ctx = init_from_env(opts.devices if opts.devices != "auto" else "auto", opts.dist_timeout)
        devices = [str(ctx.device)] * ctx.world_size
    else:
        ctx, (devices, opts) = None, process_devices(opts, dit, vae)
    job = _job(opts, devices, (dit, vae), model_dir, spawned=ctx is None, make_room=make_room,
               preview=preview)
    with open_media(src) as reader:
        output = file_output(reader, dst, opts, codec, overwrite)
        # Before the plan, on every rank alike: a second decode for auto (none for given cuts).
        job = job.with_options(_scene_cuts(job.opts, frame_count(reader), reader.frames, stats))
        if len(devices) == 1:
            return _one_process_file_job(reader, output, job, (progress, should_stop, stats))
        job = fit_for_ranks(job, devices[:1] if ctx else devices, frame_count(reader),
                            output.size, ctx.gather if ctx else None)
    if ctx is not None:
        return run_file_job(ctx, job, src, output, progress, should_stop, stats)
    return spawn_file_job(devices, job, src, output, stats, progress, preview)


def _options(facade: str, opts: Optional[Options], options: dict) -> Options:
    if opts is not None and options:
        raise UsageError(f"{facade}: options given both as opts= and as keywords "
                         f"({', '.join(sorted(options))}); give one")
    return resolve_options(**options) if opts is None else opts


def _scene_cuts(opts: Options, count: int, frames, stats: Optional[JobStats]) -> Options:
    """``opts`` with the scene cuts resolved (:mod:`.pipeline.cuts`), told to ``stats``."""
    opts = resolve_scene_cuts(opts, count, frames)
    if stats is not None:
        stats.scene_cuts = opts.scene_cuts
    return opts


def _one_process_file_job(reader, output, job: Job, report: tuple) -> Path:
    """The file job in this process: the output opened first (an unwritable or existing one
    fails before any model loads), then the models, then the sink."""
    progress, should_stop, stats = report
    count = frame_count(reader)
    writer = output.open(reader.info)
    try:
        job = job.resolved()
        models, opts = job.prepare(count, output.size, stats)
        plan = make_plan(count, opts)
        log_work(models, plan, opts, output.size)
        identity = job_identity(opts, source_digest(reader), job.models)
    except BaseException:
        writer.abort()
        raise
    with open_sink(writer, reader, output, plan, identity, models.dtype, job) as sink:
        # A direct sink's frames are rounded to integers on the device (a smaller copy to the host).
        upscaler = Upscaler(models, opts, job.faults.with_kill_points(progress),
                            should_stop, stats=stats, frames_on_device=isinstance(sink, DirectSink))
        return sink.consume(lambda batches: upscaler.batch_outputs(
            reader.frames(start=plan.read_start(batches)), plan, batches),
            upscaler.progress, upscaler.stats, upscaler.check_stop, job.preview)
