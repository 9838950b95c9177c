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
from .memory import resolve_device, resolve_dtype
from .options import Options, resolve_options
from .pipeline.plan import make_plan
from .pipeline.runner import JobStats, Models, Upscaler

Progress = Callable[[str, int, int], None]


def load_models(dit=None, vae=None, *, opts: Options, model_dir=None) -> Models:
    """DiT, VAE and text embedding on the options' device and precision."""
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    if not isinstance(dit, torch.nn.Module):
        dit = load_dit(resolve_model_file(dit or DEFAULT_DIT, model_dir, "dit"), dtype, device)
    if not isinstance(vae, torch.nn.Module):
        vae = load_vae(resolve_model_file(vae or DEFAULT_VAE, model_dir, "vae"), dtype, device)
    text = load_text_embeddings(opts.text_embeddings, dit.config.txt_in_dim, model_dir)
    return Models(dit.to(device=device, dtype=dtype), vae.to(device=device, dtype=dtype), text)


def _upscaler(models: Models, opts: Options, progress, should_stop) -> Upscaler:
    device = resolve_device(opts.device)
    return Upscaler(models, opts, device, resolve_dtype(opts.dtype, device), progress, should_stop)


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
    models = load_models(dit, vae, opts=opts, model_dir=model_dir)
    upscaler = _upscaler(models, opts, progress, should_stop)
    plan = make_plan(len(frames), opts)
    pieces = [out for _, out in upscaler.run(iter(frames), plan)]
    if stats is not None:
        stats.__dict__.update(upscaler.stats.__dict__)
    return torch.cat(pieces)


def _to_integers(frames: torch.Tensor, bit_depth: int):
    scale = 65535.0 if bit_depth == 16 else 255.0
    values = (frames * scale).round_().clamp_(0, scale).numpy()
    return values.astype("uint16" if bit_depth == 16 else "uint8")


def upscale_file(src, dst, dit=None, vae=None, *, model_dir=None, overwrite: bool = False,
                 codec: str = "h264", progress: Optional[Progress] = None,
                 should_stop: Optional[Callable[[], bool]] = None,
                 stats: Optional[JobStats] = None, **options) -> Path:
    """Upscale a video, image or image sequence file to ``dst``, streaming frame by frame.

    Video keeps its exact frame rate and its audio (copied, not re-encoded). The output is
    written under a temporary name and appears at ``dst`` only when complete; an existing
    ``dst`` is replaced only with ``overwrite=True``. Returns the output path.
    """
    from .io import open_media, open_writer
    from .pipeline.runner import output_size

    opts = resolve_options(**options)
    with open_media(src) as reader:
        info = reader.info
        frame_count = info.frame_count if info.frame_count_exact else reader.count_frames()
        plan = make_plan(frame_count, opts)
        height, width = output_size(info.height, info.width, opts)
        is_video_out = Path(dst).suffix.lower() in (".mp4", ".m4v", ".mov", ".mkv")
        bit_depth = 16 if (info.bit_depth == 16 or is_video_out and codec == "h265") else 8
        # Opening the writer first fails fast on an unwritable or existing output.
        writer = open_writer(dst, like=info, width=width, height=height, bit_depth=bit_depth,
                             codec=codec, audio_from=info if info.has_audio else None,
                             overwrite=overwrite)
        with writer:
            models = load_models(dit, vae, opts=opts, model_dir=model_dir)
            upscaler = _upscaler(models, opts, progress, should_stop)
            for _, frames in upscaler.run(reader.frames(), plan):
                writer.write_many(_to_integers(frames, bit_depth))
        if stats is not None:
            stats.__dict__.update(upscaler.stats.__dict__)
    return Path(writer.path)
