"""One process's upscaling job, streaming: frames in, upscaled frames out.

Per chunk of the batch plan the phases run over all of the chunk's batches in turn —
encode every batch, then the DiT on every latent, then decode every batch — so the models
are switched once per chunk rather than once per batch. Decoded batches are colour-corrected
against their resized input, blended where batches overlap, and yielded as soon as no later
batch can change them. Nothing holds the whole video.

Every random draw of a batch comes from generators seeded by (seed, the batch's first plan
frame, purpose), drawn on the CPU: the same seed gives the same frames whatever the chunking,
the device, or which process runs the batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..memory import tiling
from ..memory.blockswap import BlockSwap
from ..memory.budget import host_rss
from ..memory.policy import check_finite
from ..options import Options
from .alpha import upscale_alpha
from .color import color_correct
from .plan import Batch, BatchPlan, blend_weights
from .sampling import LATENT_SCALE, T, augment_latent, dit_input, make_condition, x0_from_velocity

Progress = Callable[[str, int, int], None]
log = logging.getLogger("seedvr2")

MODEL_MULTIPLE = 16  # the VAE (x8) and the DiT's 2x2 patches need multiples of 16 pixels
_LUMA = torch.tensor([0.299, 0.587, 0.114])  # ITU-R BT.601, to return grayscale inputs as gray


class Interrupted(Exception):
    """The job was stopped by its interrupt check; nothing partial is kept."""


class InputError(ValueError):
    """Input frames that cannot be upscaled; the message names the frame and the problem."""


@dataclass
class Models:
    """Loaded models with their placement: each runs on its device and, when an offload device
    is set, waits there while the other model's phase runs."""

    dit: torch.nn.Module
    vae: torch.nn.Module
    text: torch.Tensor  # (tokens, txt_in_dim) positive text embedding
    dit_device: torch.device = torch.device("cpu")
    vae_device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    dit_offload: Optional[torch.device] = None
    vae_offload: Optional[torch.device] = None
    # memory.placement.OffloadedModel or memory.blockswap.BlockSwap: moves the model's weights
    # between its offload and compute devices; None: the model stays on its device.
    dit_placement: Optional[object] = None
    vae_placement: Optional[object] = None

    @property
    def blockswap(self):
        """The DiT's BlockSwap when it swaps (on CUDA), else None."""
        return self.dit_placement if isinstance(self.dit_placement, BlockSwap) else None

    def activate(self, kind: str):
        placement = self.dit_placement if kind == "dit" else self.vae_placement
        if placement is not None:
            placement.activate()

    def park(self, kind: str):
        """Drop the model's device copies (BlockSwap: also those of a forward cut short)."""
        placement = self.dit_placement if kind == "dit" else self.vae_placement
        if placement is not None:
            placement.park()


@dataclass
class PhaseStats:
    """One phase over the whole job: time, calls, and memory peaks. Device peaks are
    ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of the phase's device, reset
    at the start of every call (None when the phase runs on the CPU); ``host_rss`` is the
    process's resident set at the end of a call, the largest seen."""

    seconds: float = 0.0
    calls: int = 0
    device_allocated: Optional[int] = None
    device_reserved: Optional[int] = None
    host_rss: Optional[int] = None

    def describe(self, name: str) -> str:
        """``encode 1.2s (device peak 3 MiB allocated, 4 MiB reserved; host RSS 900 MiB)``;
        without a CUDA device only the host RSS."""
        mib = lambda n: "n/a" if n is None else f"{n / 2**20:,.0f} MiB"  # noqa: E731
        device = "" if self.device_allocated is None and self.device_reserved is None else \
            (f"device peak {mib(self.device_allocated)} allocated, "
             f"{mib(self.device_reserved)} reserved; ")
        return f"{name} {self.seconds:.1f}s ({device}host RSS {mib(self.host_rss)})"


@dataclass
class JobStats:
    """Time and peak memory per phase, the batch size used and the memory estimate, for the
    end summary."""

    frames: int = 0
    peak_device_bytes: int = 0
    phases: dict = field(default_factory=dict)  # phase -> PhaseStats
    batch_size: int = 0  # frames per batch actually used (batch_size auto resolved)
    batch_size_auto: bool = False
    estimated_bytes: dict = field(default_factory=dict)  # device -> estimated peak (budget)
    batches_reused: int = 0  # batches a resumed job took from the kept segments
    batches_total: int = 0  # batches of the plan (set by resumable file jobs)
    ranks_lost: dict = field(default_factory=dict)  # rank -> exit code, ranks the job went on without

    def add(self, phase: str, seconds: float):
        stats = self.phases.setdefault(phase, PhaseStats())
        stats.seconds += seconds
        stats.calls += 1

    def record_memory(self, phase: str, allocated: Optional[int], reserved: Optional[int],
                      rss: Optional[int]):
        stats = self.phases.setdefault(phase, PhaseStats())
        high = lambda old, new: new if old is None else old if new is None else max(old, new)  # noqa: E731
        stats.device_allocated = high(stats.device_allocated, allocated)
        stats.device_reserved = high(stats.device_reserved, reserved)
        stats.host_rss = high(stats.host_rss, rss)
        if allocated is not None:
            self.peak_device_bytes = max(self.peak_device_bytes, allocated)

    def describe_phases(self) -> str:
        """``encode 1.2s (device peak ... allocated, ... reserved; host RSS ...), dit ...``"""
        return ", ".join(p.describe(name) for name, p in self.phases.items())


def output_size(height: int, width: int, opts: Options) -> tuple[int, int]:
    """Output (H, W): short edge = resolution, long edge capped by max_resolution, even sizes."""
    scale = opts.resolution / min(height, width)
    if opts.max_resolution and max(height, width) * scale > opts.max_resolution:
        scale = opts.max_resolution / max(height, width)
    out_h, out_w = (max(2, 2 * round(n * scale / 2)) for n in (height, width))
    if min(out_h, out_w) < 16:
        raise InputError(f"output size {out_w}x{out_h} is under 16 px on its short edge: raise "
                         f"resolution (or max_resolution) so both edges are at least 16 px")
    return out_h, out_w


def batch_seed(seed: int, first_frame: int, purpose: int) -> int:
    """A 63-bit seed per (job seed, batch, purpose); purposes keep the draws independent."""
    mixed = (seed * 0x9E3779B97F4A7C15 + first_frame * 0xBF58476D1CE4E5B9 + purpose) % (1 << 64)
    mixed ^= mixed >> 31
    return (mixed * 0x94D049BB133111EB % (1 << 64)) >> 1


def _randn(shape, seed: int, device, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


EPS, NOISE, AUG_NOISE, INPUT_NOISE = range(4)


def to_float_frame(frame, index: int) -> torch.Tensor:
    """One input frame (H, W, C) as float32 in [0, 1]; uint8/uint16 keep their full precision."""
    if isinstance(frame, np.ndarray):
        if frame.dtype == np.uint16:
            frame = torch.from_numpy(frame.astype(np.float32)) / 65535.0
        elif frame.dtype == np.uint8:
            frame = torch.from_numpy(frame).float() / 255.0
        else:
            frame = torch.from_numpy(np.asarray(frame, dtype=np.float32))
    elif frame.dtype == torch.uint8:
        frame = frame.float() / 255.0
    else:
        frame = frame.float()
    if frame.dim() == 2:
        frame = frame[..., None]
    if frame.dim() != 3 or frame.shape[-1] not in (1, 3, 4):
        raise InputError(f"frame {index} has shape {tuple(frame.shape)}: expected (H, W, C) with "
                         f"C = 1 (gray), 3 (RGB) or 4 (RGBA)")
    if not torch.isfinite(frame).all():
        raise InputError(f"frame {index} contains NaN or infinite values")
    return frame


def integer_frames(frames: torch.Tensor, bit_depth: int) -> torch.Tensor:
    """Float frames in [0, 1] -> uint8 / uint16 tensor on the frames' own device.

    On a GPU this runs there, so only the integers cross to the host (4× / 2× fewer bytes than
    float32). The result does not depend on the device: a product with a constant, rounding
    half to even and a clamp are exactly rounded IEEE operations on CPU and CUDA alike.
    """
    scale = 65535.0 if bit_depth == 16 else 255.0
    values = (frames * scale).round_().clamp_(0, scale)
    return values.to(torch.uint16 if bit_depth == 16 else torch.uint8)


def to_integer_frames(frames: torch.Tensor, bit_depth: int):
    """Float frames in [0, 1] (any device) -> uint8 / uint16 numpy arrays for the writers."""
    return integer_frames(frames, bit_depth).cpu().numpy()


class FrameSource:
    """Plan frames on demand from a forward-only frame iterator, keeping only what is still needed."""

    def __init__(self, frames: Iterable, plan: BatchPlan, first_source: int = 0,
                 needed: Optional[set] = None):
        self._iter = iter(frames)
        self._plan = plan
        self._cache: dict[int, torch.Tensor] = {}
        self._next = first_source  # source index of the next frame the iterator yields
        self._needed = needed  # source frames this job uses (None: all); others are skipped
        self.shape: Optional[tuple] = None

    def _pull(self, until: int):
        while self._next <= until:
            try:
                raw = next(self._iter)
            except StopIteration:
                raise InputError(f"the input ended after {self._next} frames; "
                                 f"{self._plan.source_frames} were expected") from None
            if self._needed is not None and self._next not in self._needed:
                self._next += 1
                continue
            frame = to_float_frame(raw, self._next)
            if self.shape is None:
                self.shape = tuple(frame.shape)
            elif tuple(frame.shape) != self.shape:
                raise InputError(f"frame {self._next} has shape {tuple(frame.shape)} but frame 0 "
                                 f"has {self.shape}: all frames must have the same size and channels")
            self._cache[self._next] = frame
            self._next += 1

    def get(self, start: int, stop: int) -> torch.Tensor:
        """Plan frames [start, stop) stacked: (n, H, W, C) float32."""
        indices = [self._plan.source_index(i) for i in range(start, stop)]
        self._pull(max(indices))
        return torch.stack([self._cache[i] for i in indices])

    def release_before(self, plan_frame: int):
        """Frames no batch starting at or after ``plan_frame`` can need are dropped."""
        keep_from = self._plan.source_start(plan_frame)
        for i in [i for i in self._cache if i < keep_from]:
            del self._cache[i]


@dataclass
class _Encoded:
    batch: Batch
    latent: torch.Tensor  # (t, h, w, 16) scaled, channels-last
    reference: torch.Tensor  # (n, 3, H, W) resized input in [-1, 1], for colour correction
    alpha: Optional[torch.Tensor]  # (n, 1, h0, w0) input alpha in [0, 1]
    gray: bool
    result: Optional[torch.Tensor] = None  # x0 latent, then decoded frames


class Upscaler:
    """Runs a batch plan over a frame stream with loaded models."""

    def __init__(self, models: Models, opts: Options, progress: Optional[Progress] = None,
                 should_stop: Optional[Callable[[], bool]] = None):
        self.models, self.opts, self.dtype = models, opts, models.dtype
        self.progress = progress or (lambda phase, done, total: None)
        self.should_stop = should_stop or (lambda: False)
        # Latents and frames wait here between phases ("none": on the device that made them).
        self.offload = torch.device(opts.tensor_offload_device) \
            if opts.tensor_offload_device != "none" else models.vae_device
        self.encode_tiles, self.encode_slice = tiling.settings_from_options(opts, "encode")
        self.decode_tiles, self.decode_slice = tiling.settings_from_options(opts, "decode")
        self.stats = JobStats()
        # A file job's consumer rounds frames to integers: on the device, the copy to the
        # host is then 4x (uint8) or 2x (uint16) smaller than float32 frames. Only decoded
        # frames stay; the blender keeps just the overlap frames between batches.
        self.frames_on_device = False
        if isinstance(opts.batch_size, int):
            self.stats.batch_size = opts.batch_size

    # -- phases ---------------------------------------------------------------------------

    def _encode(self, batch: Batch, frames: torch.Tensor, size: tuple[int, int]) -> _Encoded:
        opts, vae, device = self.opts, self.models.vae, self.models.vae_device
        channels = frames.shape[-1]
        x = frames.to(device).permute(0, 3, 1, 2)  # (n, C, H, W)
        alpha = x[:, 3:4].to(self.offload) if channels == 4 else None
        rgb = x[:, :3] if channels >= 3 else x.expand(-1, 3, -1, -1)
        resized = F.interpolate(rgb, size=size, mode="bicubic", antialias=True,
                                align_corners=False).clamp_(0, 1)
        reference = resized * 2 - 1
        pad_h, pad_w = (-n % MODEL_MULTIPLE for n in size)
        video = F.pad(reference, (0, pad_w, 0, pad_h), mode="replicate") if pad_h or pad_w else reference
        if batch.length > batch.frames:  # repeat the last frame up to 4n+1
            video = torch.cat([video, video[-1:].expand(batch.length - batch.frames, -1, -1, -1)])
        video = video.permute(1, 0, 2, 3)[None]  # (1, 3, T, H, W)
        if opts.input_noise_scale > 0:
            noise = _randn(video.shape, batch_seed(opts.seed, batch.start, INPUT_NOISE), device)
            video = video + 0.025 * opts.input_noise_scale * noise
        mean, logvar = tiling.encode_posterior(vae, video.to(self.dtype), self.encode_tiles,
                                              self.encode_slice)
        eps = _randn(mean.shape, batch_seed(opts.seed, batch.start, EPS), device, mean.dtype)
        latent = vae.sample_posterior(mean, logvar, noise=eps)
        latent = (latent[0].permute(1, 2, 3, 0).float() * LATENT_SCALE).to(self.offload)
        return _Encoded(batch, latent, reference.to(self.offload), alpha, channels == 1)

    def _denoise(self, item: _Encoded):
        opts, dit, device = self.opts, self.models.dit, self.models.dit_device
        latent = item.latent.to(device)
        seed = lambda purpose: batch_seed(opts.seed, item.batch.start, purpose)  # noqa: E731
        noise = _randn(latent.shape, seed(NOISE), device)
        if opts.latent_noise_scale > 0:
            latent = augment_latent(latent, _randn(latent.shape, seed(AUG_NOISE), device),
                                    opts.latent_noise_scale)
        vid = dit_input(noise, make_condition(latent))
        t, h, w, _ = vid.shape
        text = self.models.text.to(device)
        # Shapes stay on the CPU (the DiT reads them as Python numbers: on the device that
        # would be a copy there and a sync back); the timestep is filled on the device.
        v = dit(vid.reshape(-1, vid.shape[-1]).to(self.dtype), text.to(self.dtype),
                torch.tensor([[t, h, w]]), torch.tensor([[text.shape[0]]]),
                torch.full((1,), T, device=device))
        check_finite(v, "DiT", self.dtype)
        item.result = x0_from_velocity(noise, v.float().reshape(noise.shape)).to(self.offload)
        item.latent = None

    def _decode(self, item: _Encoded, size: tuple[int, int]) -> torch.Tensor:
        device = self.models.vae_device
        z = (item.result.to(device) / LATENT_SCALE).permute(3, 0, 1, 2)[None]
        video = tiling.decode(self.models.vae, z.to(self.dtype), self.decode_tiles,
                              self.decode_slice)  # (1, 3, T, H16, W16)
        check_finite(video, "VAE decoder", self.dtype)
        n = item.batch.frames
        frames = video[0, :, :n, : size[0], : size[1]].permute(1, 0, 2, 3).float()  # (n, 3, H, W)
        frames = color_correct(frames, item.reference.to(device), self.opts.color_correction)
        rgb = ((frames.clamp(-1, 1) + 1) / 2)
        if item.gray:
            out = (rgb * _LUMA.to(rgb.device)[None, :, None, None]).sum(1, keepdim=True)
        elif item.alpha is not None:
            out = torch.cat([rgb, upscale_alpha(item.alpha.to(device), rgb)], dim=1)
        else:
            out = rgb
        item.result = None
        return out.permute(0, 2, 3, 1).to(device if self.frames_on_device else self.offload)

    # -- the job --------------------------------------------------------------------------

    def _check_stop(self):
        if self.should_stop():
            raise Interrupted("upscaling interrupted")

    def _timed(self, phase: str, fn, *args):
        device = self.models.dit_device if phase == "dit" else self.models.vae_device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            if cuda:
                torch.cuda.synchronize(device)
            self.stats.add(phase, time.perf_counter() - start)
            self.stats.record_memory(
                phase, torch.cuda.max_memory_allocated(device) if cuda else None,
                torch.cuda.max_memory_reserved(device) if cuda else None, host_rss())

    @torch.inference_mode()
    def batch_outputs(self, frames: Iterable, plan: BatchPlan,
                      batches: Optional[Sequence[int]] = None) -> Iterator[tuple[Batch, torch.Tensor]]:
        """Decoded, colour-corrected frames (n, H, W, C) of each batch, unblended, in plan order.

        ``batches`` (contiguous, ascending) restricts the job to a share of the plan; ``frames``
        must then start at :meth:`BatchPlan.read_start` of them.
        """
        chosen = list(range(len(plan.batches))) if batches is None else list(batches)
        first_source = plan.read_start(chosen)
        needed = None if batches is None else {
            plan.source_index(f) for i in chosen for f in range(plan.batches[i].start, plan.batches[i].stop)}
        source = FrameSource(frames, plan, first_source, needed)
        total = len(chosen)
        done = {"encode": 0, "dit": 0, "decode": 0}
        wanted = set(chosen)
        try:
            for chunk in plan.chunks:
                chunk = [i for i in chunk if i in wanted]
                if not chunk:
                    continue
                items = []
                size = None
                self.models.activate("vae")
                for i in chunk:
                    self._check_stop()
                    b = plan.batches[i]
                    raw = source.get(b.start, b.stop)
                    size = size or output_size(raw.shape[1], raw.shape[2], self.opts)
                    items.append(self._timed("encode", self._encode, b, raw, size))
                    del raw
                    source.release_before(plan.batches[i + 1].start if i + 1 < len(plan.batches)
                                          else plan.plan_frames)
                    done["encode"] += 1
                    self.progress("encode", done["encode"], total)
                self.models.park("vae")
                self.models.activate("dit")
                for item in items:
                    self._check_stop()
                    self._timed("dit", self._denoise, item)
                    done["dit"] += 1
                    self.progress("dit", done["dit"], total)
                self.models.park("dit")
                self.models.activate("vae")
                for item in items:
                    self._check_stop()
                    out = self._timed("decode", self._decode, item, size)
                    done["decode"] += 1
                    self.progress("decode", done["decode"], total)
                    yield item.batch, out
                    del out
        finally:
            # Also after an error or interrupt: no weights copies or tensors stay on the device.
            self.models.park("dit")
            self.models.park("vae")
            for name, phase in self.stats.phases.items():
                log.debug("phase %s: %s", name, phase.describe(f"{phase.calls} call(s)"))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def run(self, frames: Iterable, plan: BatchPlan) -> Iterator[tuple[int, torch.Tensor]]:
        """Yields (first source frame, frames (n, H, W, C) float32 in [0, 1]) in order."""
        blender = OverlapBlender(plan)
        for batch, out in self.batch_outputs(frames, plan):
            for first, final in blender.add(batch, out):
                self.stats.frames = blender.emitted
                yield first, final
                self.progress("frames", blender.emitted, plan.source_frames)


class OverlapBlender:
    """Turns per-batch outputs, given in plan order, into final frames: cross-fades each
    overlap and drops the prepended frames. Whoever gathers batches (one process or the
    writer rank of many) blends through this one class, so results are identical."""

    def __init__(self, plan: BatchPlan):
        self.plan = plan
        self.pending: Optional[torch.Tensor] = None  # previous batch's frames not yet final
        self.emitted = 0

    def add(self, b: Batch, out: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        plan = self.plan
        if b.overlap and self.pending is not None:
            # The weights go where the frames are (a file job keeps them on the GPU).
            w = blend_weights(b.overlap).to(out.device)[:, None, None, None]
            out = torch.cat([self.pending * (1 - w) + out[: b.overlap] * w, out[b.overlap:]])
        final_stop = plan.emit_stop(b)
        self.pending = out[final_stop - b.start:]
        first = max(b.start, plan.prepend)
        if first < final_stop:
            final = out[first - b.start: final_stop - b.start]
            self.emitted += final.shape[0]
            yield first - plan.prepend, final
