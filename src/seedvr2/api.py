"""The facade every interface calls: ``upscale`` (frames in memory) and ``upscale_file``.

Options are validated once (``seedvr2.options``); models may be given loaded, or by registered
name or path and are then loaded (``seedvr2.pipeline.setup``, shared with the distributed
ranks). Before any frame is processed, ``prepare_job`` resolves ``batch_size="auto"`` and
checks the job against the memory of each CUDA device (``seedvr2.memory.budget``), so a job
that cannot fit stops up front with the settings that would, instead of running out of
memory mid-video. Here the facade only decides: one process, or several
(``seedvr2.distributed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from .options import OptionError, Options, option_ref, option_value, resolve_options
from .pipeline.plan import make_plan
from .io.background import BackgroundWriter
from .pipeline.resume import install_kill_hook, open_resume_state, run_resumable
from .pipeline.runner import (JobStats, Models, Upscaler, input_frames, output_size,
                              to_integer_frames)
from .pipeline.setup import (MEMORY_CHECK_ENV, check_file_job, file_facts, load_models,
                             open_output, plan_file, prepare_job, resolve_auto_batch_for_ranks)

# The set-up steps are the library's too (custom pipelines, the CLI, tests).
__all__ = ["MEMORY_CHECK_ENV", "check_file_job", "load_models", "open_output", "plan_file",
           "prepare_job", "process_devices", "resolve_auto_batch_for_ranks", "upscale",
           "upscale_file"]

Progress = Callable[[str, int, int], None]


def _upscaler(models: Models, opts: Options, progress, should_stop) -> Upscaler:
    return Upscaler(models, opts, progress, should_stop)


def _check_one_process(opts: Options):
    if opts.sequence_parallel > 1:
        raise OptionError(f"{option_value('sequence_parallel', opts.sequence_parallel)} needs as "
                          f"many ranks: list the devices ({option_ref('devices', 'cuda:0,cuda:1')}) "
                          f"or launch with torchrun")


def process_devices(opts: Options, dit, vae) -> tuple[list[str], Options]:
    """The devices to run on, one process each, and the options of a single process.

    ``devices=auto`` spreads the job over every visible GPU only when nothing ties it to one:
    an explicit ``device``, ``dit_device`` or ``vae_device`` means one process there, and
    models given loaded mean one process on their device (the modules cannot travel to
    worker processes). A device list given explicitly is obeyed as it is.
    """
    from .distributed.launch import parse_devices

    if opts.devices == "auto":
        chosen = [getattr(opts, name) for name in ("device", "dit_device", "vae_device")]
        if any(d != "auto" for d in chosen):
            return [next(d for d in chosen if d != "auto")], opts
        on_gpu = [_module_device(m) for m in (dit, vae) if isinstance(m, torch.nn.Module)]
        on_gpu = [d for d in on_gpu if d is not None and d.type == "cuda"]
        if on_gpu:
            return [str(on_gpu[0])], opts.replace(device=str(on_gpu[0]))
        if isinstance(dit, torch.nn.Module) or isinstance(vae, torch.nn.Module):
            return [opts.device], opts  # on the CPU: auto places them on the current GPU
    devices = parse_devices(opts.devices)
    if len(devices) == 1 and opts.device == "auto" and opts.devices != "auto":
        opts = opts.replace(device=devices[0])
    return devices, opts


def _module_device(module: torch.nn.Module) -> Optional[torch.device]:
    first = next(iter(module.parameters()), None)
    return None if first is None else first.device


def _check_named_models(dit, vae):
    if isinstance(dit, torch.nn.Module) or isinstance(vae, torch.nn.Module):
        raise ValueError("several devices need the models by name or path (each worker "
                         "loads its own), not loaded modules")


def upscale(frames, dit=None, vae=None, *, model_dir=None, progress: Optional[Progress] = None,
            should_stop: Optional[Callable[[], bool]] = None, stats: Optional[JobStats] = None,
            **options) -> torch.Tensor:
    """Upscale frames in memory: ComfyUI's IMAGE convention in and out.

    ``frames``: float (T, H, W, C) in [0, 1] (or uint8/uint16), C = 1, 3 or 4; a single
    (H, W, C) image is one frame. Returns float32 (T, H', W', C) in [0, 1] on the CPU.
    """
    opts = resolve_options(**options)
    frames = input_frames(frames)
    devices, opts = process_devices(opts, dit, vae)
    if len(devices) > 1:
        from .distributed.job import check_sequence_parallel
        from .distributed.launch import spawn_tensor_job

        _check_named_models(dit, vae)
        check_sequence_parallel(opts, len(devices), dit, model_dir)
        size = output_size(frames.shape[1], frames.shape[2], opts)
        opts = resolve_auto_batch_for_ranks(opts, devices, dit, vae, model_dir, len(frames), size)
        out_shape = (len(frames), *size, frames.shape[3])
        return spawn_tensor_job(devices, frames, out_shape, dit, vae, model_dir=model_dir,
                                progress=progress, should_stop=should_stop,
                                **{**options, "batch_size": opts.batch_size})
    _check_one_process(opts)
    models = load_models(dit, vae, opts=opts, model_dir=model_dir)
    job_stats = JobStats()
    opts = prepare_job(models, opts, len(frames), output_size(frames.shape[1], frames.shape[2], opts),
                       job_stats)
    upscaler = _upscaler(models, opts, progress, should_stop)
    upscaler.stats = job_stats
    plan = make_plan(len(frames), opts)
    pieces = [out for _, out in upscaler.run(iter(frames), plan)]
    if stats is not None:
        stats.__dict__.update(upscaler.stats.__dict__)
    return torch.cat(pieces)


def upscale_file(src, dst, dit=None, vae=None, *, model_dir=None, overwrite: bool = False,
                 codec: str = "h264", progress: Optional[Progress] = None,
                 should_stop: Optional[Callable[[], bool]] = None,
                 stats: Optional[JobStats] = None, **options) -> Path:
    """Upscale a video, image or image sequence file to ``dst``, streaming frame by frame.

    Video keeps its exact frame rate (variable-rate video: every frame's time) and its audio
    and subtitles where the output holds them (copied, not re-encoded); ``fps`` gives images
    and sequences a rate for a video output. The output is
    written under a temporary name and appears at ``dst`` only when complete; an existing
    ``dst`` is replaced only with ``overwrite=True``. Returns the output path.
    """
    from .distributed import in_distributed_launch, init_from_env
    from .distributed.job import check_sequence_parallel, run_file_job
    from .distributed.launch import spawn_file_job
    from .io import open_media

    opts = resolve_options(**options)
    job = dict(model_dir=model_dir, overwrite=overwrite, codec=codec, **options)
    def ranks_auto(devices, gather=None):
        if opts.batch_size == "auto":
            with open_media(src) as reader:
                count, size, _ = file_facts(reader, dst, opts, codec)
            job["batch_size"] = resolve_auto_batch_for_ranks(
                opts, devices, dit, vae, model_dir, count, size, gather).batch_size

    if in_distributed_launch():  # torchrun / Slurm: this process is one rank
        ctx = init_from_env(opts.devices if opts.devices != "auto" else "auto", opts.dist_timeout)

        def gather(value):
            import torch.distributed as dist

            values = [None] * ctx.world_size
            dist.all_gather_object(values, value)
            return values
        ranks_auto([str(ctx.device)], gather)
        return run_file_job(ctx, src, dst, dit, vae, progress=progress, should_stop=should_stop,
                            stats=stats, **job)
    devices, opts = process_devices(opts, dit, vae)
    if len(devices) > 1:
        _check_named_models(dit, vae)
        check_sequence_parallel(opts, len(devices), dit, model_dir)
        ranks_auto(devices)
        return spawn_file_job(devices, src, dst, dit, vae, stats=stats, **job)
    _check_one_process(opts)
    with open_media(src) as reader:
        frame_count, size, bit_depth = file_facts(reader, dst, opts, codec)
        # Opening the writer first fails fast on an unwritable or existing output.
        writer = open_output(reader.info, dst, size, bit_depth, codec, overwrite, opts.fps)
        try:
            models = load_models(dit, vae, opts=opts, model_dir=model_dir)
            job_stats = JobStats()
            opts = prepare_job(models, opts, frame_count, size, job_stats)
            plan = make_plan(frame_count, opts)
            upscaler = _upscaler(models, opts, progress, should_stop)
            upscaler.stats = job_stats
            state = open_resume_state(reader, dst, opts, plan, size, bit_depth, codec, dit, vae,
                                      model_dir, models.dtype)
        except BaseException:
            writer.abort()
            raise
        if state is None:
            # Encoding runs on a thread from a bounded queue while the device computes on.
            with BackgroundWriter(writer) as output:
                upscaler.frames_on_device = True  # rounded there, copied to the host as integers
                for _, frames in upscaler.run(reader.frames(), plan):
                    output.write_many(to_integer_frames(frames, bit_depth))
        else:
            writer.abort()  # the kept segments become the output instead
            def compute(batches):
                return upscaler.batch_outputs(reader.frames(start=plan.read_start(batches)),
                                              plan, batches)
            install_kill_hook(upscaler)
            path = run_resumable(compute, dst, plan, state, info=reader.info, size=size,
                                 bit_depth=bit_depth, codec=codec, overwrite=overwrite,
                                 progress=upscaler.progress, stats=job_stats, fps=opts.fps)
        if stats is not None:
            stats.__dict__.update(upscaler.stats.__dict__)
    return Path(writer.path) if state is None else path
