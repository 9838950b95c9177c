"""The facade every interface calls: ``upscale`` (frames in memory) and ``upscale_file``.

Options are validated once (``seedvr2.options``); models may be given loaded, or by registered
name or path and are then loaded here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from .loading import load_dit, load_vae
from .loading.registry import DEFAULT_DIT, DEFAULT_VAE, default_model_dir, resolve_model_file
from .loading.text import load_text_embeddings
from .memory import MODEL_CACHE, ModelKey, resolve_device, resolve_dtype, resolve_offload
from .memory.blockswap import BlockSwap
from .memory.compile import CompileSettings, apply_compile
from .options import OptionError, Options, resolve_options
from .pipeline.plan import make_plan
from .pipeline.runner import JobStats, Models, Upscaler, output_size, to_integer_frames

Progress = Callable[[str, int, int], None]


def _settings_of(opts: Options, kind: str) -> tuple:
    """The options that shape a loaded model (its cache key besides file, dtype and device)."""
    compiled = CompileSettings.from_options(opts)
    if kind == "vae":
        return (compiled,)
    return (compiled, opts.blocks_to_swap, opts.swap_io_components, opts.dit_offload_device,
            opts.attention_backend)


def _load_dit(path: Path, opts: Options, dtype, device, offload):
    swapping = opts.blocks_to_swap > 0 or opts.swap_io_components
    if swapping and offload is None:
        raise OptionError("blocks_to_swap/swap_io_components need an offload device for the "
                          "swapped weights: set dit_offload_device (e.g. cpu)")
    # With BlockSwap the weights load on the offload device; only resident ones reach the GPU.
    dit = load_dit(path, dtype, offload if swapping else device)
    dit.set_attention_backend(opts.attention_backend)
    blockswap = BlockSwap(dit, opts.blocks_to_swap, opts.swap_io_components, device, offload) \
        if swapping else None
    apply_compile(dit, None, CompileSettings.from_options(opts))
    return dit, blockswap


def load_models(dit=None, vae=None, *, opts: Options, model_dir=None) -> Models:
    """DiT, VAE and text embedding placed and prepared as the options say (cached if asked)."""
    device = resolve_device(opts.device)
    dit_device = resolve_device(opts.dit_device) if opts.dit_device != "auto" else device
    vae_device = resolve_device(opts.vae_device) if opts.vae_device != "auto" else device
    dtype = resolve_dtype(opts.dtype, dit_device)
    dit_offload, vae_offload = (resolve_offload(opts.dit_offload_device),
                                resolve_offload(opts.vae_offload_device))
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    blockswap = None
    if isinstance(dit, torch.nn.Module):
        dit = dit.to(device=dit_device, dtype=dtype)
    else:
        path = resolve_model_file(dit or DEFAULT_DIT, model_dir, "dit", download_missing=True)
        key = ModelKey.for_file("dit", path, dtype, dit_device, _settings_of(opts, "dit"))
        dit, blockswap = MODEL_CACHE.get_or_load(
            key, lambda: _load_dit(path, opts, dtype, dit_device, dit_offload), opts.cache_dit)
    if isinstance(vae, torch.nn.Module):
        vae = vae.to(device=vae_device, dtype=dtype)
    else:
        path = resolve_model_file(vae or DEFAULT_VAE, model_dir, "vae", download_missing=True)
        key = ModelKey.for_file("vae", path, dtype, vae_device, _settings_of(opts, "vae"))

        def load():
            model = load_vae(path, dtype, vae_device)
            apply_compile(None, model, CompileSettings.from_options(opts))
            return model
        vae = MODEL_CACHE.get_or_load(key, load, opts.cache_vae)
    embedded = getattr(dit, "embedded_text_embeddings", None) or {}
    text = load_text_embeddings(opts.text_embeddings, dit.config.txt_in_dim, model_dir,
                                embedded=embedded.get("pos"))
    return Models(dit, vae, text, dit_device, vae_device, dtype, dit_offload, vae_offload, blockswap)


def _upscaler(models: Models, opts: Options, progress, should_stop) -> Upscaler:
    return Upscaler(models, opts, progress, should_stop)


def _check_one_process(opts: Options):
    if opts.sequence_parallel > 1:
        raise OptionError(f"sequence_parallel = {opts.sequence_parallel} needs as many ranks: "
                          f"list the devices (devices=cuda:0,cuda:1) or launch with torchrun")


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
    if frames.dim() == 3 if isinstance(frames, torch.Tensor) else frames.ndim == 3:
        frames = frames[None]
    if len(frames) == 0:
        raise ValueError("frames: the input has no frames")
    from .distributed.launch import parse_devices

    devices = parse_devices(opts.devices)
    if len(devices) > 1:
        from .distributed.launch import spawn_tensor_job

        _check_named_models(dit, vae)
        frames = torch.as_tensor(frames)
        out_shape = (len(frames), *output_size(frames.shape[1], frames.shape[2], opts), frames.shape[3])
        return spawn_tensor_job(devices, frames, out_shape, dit, vae, model_dir=model_dir,
                                progress=progress, should_stop=should_stop, **options)
    _check_one_process(opts)
    opts = opts.replace(device=devices[0]) if opts.device == "auto" and opts.devices != "auto" else opts
    models = load_models(dit, vae, opts=opts, model_dir=model_dir)
    upscaler = _upscaler(models, opts, progress, should_stop)
    plan = make_plan(len(frames), opts)
    pieces = [out for _, out in upscaler.run(iter(frames), plan)]
    if stats is not None:
        stats.__dict__.update(upscaler.stats.__dict__)
    return torch.cat(pieces)


VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv")


def plan_file(reader, dst, opts: Options, codec: str):
    """Batch plan, output (H, W) and bit depth of a file job: the same in one process and on
    every rank of a distributed one."""
    info = reader.info
    frame_count = info.frame_count if info.frame_count_exact else reader.count_frames()
    is_video_out = Path(str(dst)).suffix.lower() in VIDEO_SUFFIXES
    bit_depth = 16 if info.bit_depth == 16 or is_video_out and codec == "h265" else 8
    return make_plan(frame_count, opts), output_size(info.height, info.width, opts), bit_depth


def open_output(info, dst, size: tuple[int, int], bit_depth: int, codec: str, overwrite: bool):
    """The writer for a file job's output (audio copied from the source when it has some)."""
    from .io import open_writer

    return open_writer(dst, like=info, width=size[1], height=size[0], bit_depth=bit_depth,
                       codec=codec, audio_from=info if info.has_audio else None,
                       overwrite=overwrite)


def upscale_file(src, dst, dit=None, vae=None, *, model_dir=None, overwrite: bool = False,
                 codec: str = "h264", progress: Optional[Progress] = None,
                 should_stop: Optional[Callable[[], bool]] = None,
                 stats: Optional[JobStats] = None, **options) -> Path:
    """Upscale a video, image or image sequence file to ``dst``, streaming frame by frame.

    Video keeps its exact frame rate and its audio (copied, not re-encoded). The output is
    written under a temporary name and appears at ``dst`` only when complete; an existing
    ``dst`` is replaced only with ``overwrite=True``. Returns the output path.
    """
    from .distributed import in_distributed_launch, init_from_env
    from .distributed.job import run_file_job
    from .distributed.launch import parse_devices, spawn_file_job
    from .io import open_media

    opts = resolve_options(**options)
    job = dict(model_dir=model_dir, overwrite=overwrite, codec=codec, **options)
    if in_distributed_launch():  # torchrun / Slurm: this process is one rank
        ctx = init_from_env(opts.devices if opts.devices != "auto" else "auto", opts.dist_timeout)
        return run_file_job(ctx, src, dst, dit, vae, progress=progress, should_stop=should_stop, **job)
    devices = parse_devices(opts.devices)
    if len(devices) > 1:
        _check_named_models(dit, vae)
        return spawn_file_job(devices, src, dst, dit, vae, **job)
    _check_one_process(opts)
    opts = opts.replace(device=devices[0]) if opts.device == "auto" and opts.devices != "auto" else opts
    with open_media(src) as reader:
        plan, size, bit_depth = plan_file(reader, dst, opts, codec)
        # Opening the writer first fails fast on an unwritable or existing output.
        writer = open_output(reader.info, dst, size, bit_depth, codec, overwrite)
        with writer:
            models = load_models(dit, vae, opts=opts, model_dir=model_dir)
            upscaler = _upscaler(models, opts, progress, should_stop)
            for _, frames in upscaler.run(reader.frames(), plan):
                writer.write_many(to_integer_frames(frames, bit_depth))
        if stats is not None:
            stats.__dict__.update(upscaler.stats.__dict__)
    return Path(writer.path)
