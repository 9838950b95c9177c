"""One process's upscaling job, streaming: frames in, upscaled frames out.

Per chunk of the batch plan each phase runs over all of the chunk's batches (encode, DiT,
decode), so the models are switched once per chunk. Decoded batches are colour-corrected
against their resized input, blended where batches overlap, and yielded as soon as no later
batch can change them; nothing holds the whole video. Every random draw is seeded by (seed,
the batch's first plan frame, purpose) on the CPU: the same frames whatever the chunking,
the device, or which process runs the batch."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from ..memory import tiling
from ..memory.budget import host_rss
from ..memory.compile import is_compiled
from ..memory.device_choice import check_finite
from ..models.window import to_device
from ..options import Options
from .alpha import upscale_alpha
from .color import color_correct
from .plan import Batch, BatchPlan, blend_weights
from .readahead import ReadAhead
from .sampling import LATENT_SCALE, T, augment_latent, dit_input, make_condition, x0_from_velocity

Progress = Callable[[str, int, int], None]
log = logging.getLogger("seedvr2")

MODEL_MULTIPLE = 16  # the VAE (x8) and the DiT's 2x2 patches need multiples of 16 pixels
_LUMA = torch.tensor([0.299, 0.587, 0.114])  # ITU-R BT.601, to return grayscale inputs as gray


class Interrupted(Exception):
    """The job was stopped by its interrupt check; batches not finished are not kept (a
    resumable file job keeps the segments already written)."""


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
    # OffloadedModel or BlockSwap (memory/): moves weights between offload and compute; None: stays.
    dit_placement: Optional[object] = None
    vae_placement: Optional[object] = None

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
    """One phase over the whole job: time, calls, and memory peaks (the CUDA allocator's,
    reset every call; None on the CPU), ``host_rss`` the largest resident set after a call."""

    seconds: float = 0.0
    calls: int = 0
    device_allocated: Optional[int] = None
    device_reserved: Optional[int] = None
    host_rss: Optional[int] = None

    def describe(self, name: str) -> str:
        """``encode 1.2s (device peak 3 MiB allocated, 4 MiB reserved; host RSS 900 MiB)``."""
        mib = lambda n: "n/a" if n is None else f"{n / 2**20:,.0f} MiB"  # noqa: E731
        device = "" if self.device_allocated is None and self.device_reserved is None else \
            (f"device peak {mib(self.device_allocated)} allocated, "
             f"{mib(self.device_reserved)} reserved; ")
        return f"{name} {self.seconds:.1f}s ({device}host RSS {mib(self.host_rss)})"


@dataclass
class JobStats:
    """Time and peak memory per phase, the batch size and memory estimate, for the summary."""

    frames: int = 0
    peak_device_bytes: int = 0
    phases: dict = field(default_factory=dict)  # phase -> PhaseStats
    batch_size: int = 0  # frames per batch actually used (batch_size auto resolved)
    batch_size_auto: bool = False
    estimated_bytes: dict = field(default_factory=dict)  # device -> estimated peak (budget)
    batches_reused: int = 0  # batches a resumed job took from the kept segments
    batches_total: int = 0  # batches of the plan (set by resumable file jobs)
    ranks_lost: dict = field(default_factory=dict)  # rank -> exit code, ranks the job went on without
    scene_cuts: Optional[tuple] = None  # the cuts the plan kept to (None: not known here)

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


def _batch_name(batch: Batch) -> str:
    """``batch 2 (frames 8 to 15)``: a batch for messages, by its plan frames counted from 0."""
    return f"batch {batch.index} (frames {batch.start} to {batch.stop - 1})"


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
    return to_device(torch.randn(shape, generator=generator), device).to(dtype)


EPS, NOISE, AUG_NOISE, INPUT_NOISE = range(4)
_INTEGER_SCALE = {torch.uint8: 255.0, torch.uint16: 65535.0}


def source_frame(frame, index: int) -> torch.Tensor:
    """One input frame (H, W, C) as a checked CPU tensor: uint8 / uint16 stay integers (converted on
    the compute device: 4x / 2x fewer bytes cross than float32), the rest float32 in [0, 1]."""
    if isinstance(frame, np.ndarray):
        if frame.dtype in (np.uint8, np.uint16):
            frame = torch.from_numpy(np.ascontiguousarray(frame))
        else:
            frame = torch.from_numpy(np.asarray(frame, dtype=np.float32))
    else:
        frame = frame.detach()  # read, never differentiated: numpy() refuses a graph's tensor
        if frame.dtype not in _INTEGER_SCALE:
            frame = frame.float()
    if frame.dim() == 2:
        frame = frame[..., None]
    if frame.dim() != 3 or frame.shape[-1] not in (1, 3, 4):
        raise InputError(f"frame {index} has shape {tuple(frame.shape)}: expected (H, W, C) with "
                         f"C = 1 (gray), 3 (RGB) or 4 (RGBA)")
    if frame.is_floating_point() and not torch.isfinite(frame).all():
        raise InputError(f"frame {index} contains NaN or infinite values")
    return frame


def _stacked(frames) -> torch.Tensor:
    """A list of frames (as ComfyUI's VideoComponents may hold them) as one tensor."""
    if not frames:
        raise InputError("frames: the input has no frames")
    try:
        frames = [torch.as_tensor(frame).detach() for frame in frames]
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"frames: not a list of images ({e})") from None
    for index, frame in enumerate(frames):
        if frame.shape != frames[0].shape or frame.dtype != frames[0].dtype:
            raise InputError(f"frame {index} is {tuple(frame.shape)} {frame.dtype}, frame 0 "
                             f"{tuple(frames[0].shape)} {frames[0].dtype}: the frames of one "
                             f"video must have one size")
    return torch.stack(frames)


def input_frames(frames) -> torch.Tensor:
    """In-memory input (ComfyUI's IMAGE convention, or a numpy array) as a checked
    (T, H, W, C) tensor, before any model loads. uint8 / uint16 keep their scale (255 /
    65535); other integer dtypes take 0..255 when every value fits, else 0..65535, and
    anything else is an error (an int64 0..255 tensor read as [0, 1] would saturate to
    white). Floats outside [0, 1] are clamped, with one warning naming the first such frame
    and the range found (resamplers upstream overshoot a little; refusing would break
    workflows). NaN and infinite values are refused, naming the first such frame."""
    frames = _stacked(frames) if isinstance(frames, (list, tuple)) else \
        torch.as_tensor(frames).detach()
    if frames.dim() == 3:
        frames = frames[None]
    shape = tuple(frames.shape)
    if frames.dim() == 4 and shape[0] == 0:
        raise InputError("frames: the input has no frames")
    if frames.dim() != 4 or 0 in shape or shape[-1] not in (1, 3, 4):
        raise InputError(f"frames have shape {shape}: expected (T, H, W, C) with T, H and W at "
                         f"least 1 and C = 1 (gray), 3 (RGB) or 4 (RGBA)")
    if frames.dtype in _INTEGER_SCALE:
        return frames
    if frames.dtype == torch.bool or frames.is_complex():
        raise InputError(f"frames are {frames.dtype}: give float32 in [0, 1], or uint8 / uint16")
    if not frames.is_floating_point():
        low, high = frames.min().item(), frames.max().item()
        fits = [dtype for dtype, top in _INTEGER_SCALE.items() if low >= 0 and high <= top]
        if not fits:
            raise InputError(f"frames are {frames.dtype} with values {low}..{high}: integer "
                             f"frames must be 0..255 (8-bit) or 0..65535 (16-bit); give float32 "
                             f"in [0, 1] for anything else")
        return frames.to(fits[0])
    # Per-frame reductions (no input-sized temporary) propagate NaN; an infinity is a min or max.
    low, high = frames.amin(dim=(1, 2, 3)), frames.amax(dim=(1, 2, 3))
    finite = torch.isfinite(low) & torch.isfinite(high)
    if not finite.all():
        raise InputError(f"frame {int((~finite).nonzero()[0])} contains NaN or infinite values")
    outside = (low < 0) | (high > 1)
    if outside.any():
        first = int(outside.nonzero()[0])
        warnings.warn(f"frames: {int(outside.sum())} of {len(frames)} have values outside "
                      f"[0, 1] (frame {first}: {low[first].item():g}..{high[first].item():g}); "
                      f"they are clamped to [0, 1]", stacklevel=3)
        frames = frames.clamp(0.0, 1.0)
    return frames


def unit_float(frames: torch.Tensor) -> torch.Tensor:
    """Source frames (any device) as float32 in [0, 1]; uint8/uint16 keep their full
    precision. The division is exactly rounded, so the values do not depend on the device."""


    scale = _INTEGER_SCALE.get(frames.dtype)
    return frames.float() if scale is None else frames.float() / scale


def to_float_frame(frame, index: int) -> torch.Tensor:
    """One input frame (H, W, C) as float32 in [0, 1] on the CPU."""
    return unit_float(source_frame(frame, index))


def integer_frames(frames: torch.Tensor, bit_depth: int) -> torch.Tensor:
    """Float frames in [0, 1] -> uint8 / uint16 on their own device (only integers cross to the
    host), device-independent: product, round half to even and clamp are exact IEEE ops."""
    scale = 65535.0 if bit_depth == 16 else 255.0
    values = (frames * scale).round_().clamp_(0, scale)
    return values.to(torch.uint16 if bit_depth == 16 else torch.uint8)


def to_integer_frames(frames: torch.Tensor, bit_depth: int):
    """Float frames in [0, 1] (any device) -> uint8 / uint16 numpy arrays for the writers."""
    return integer_frames(frames, bit_depth).cpu().numpy()


class FrameSource:
    """Plan frames on demand from a forward-only frame iterator, keeping only what is still
    needed, in source precision; ``pin``: pinned, so copies to a CUDA device do not block."""

    def __init__(self, frames: Iterable, plan: BatchPlan, first_source: int = 0,
                 needed: Optional[set] = None, pin: bool = False):
        self._iter = iter(frames)
        self._pin = pin
        self._plan = plan
        self._cache: dict[int, torch.Tensor] = {}
        self._next = first_source  # source index of the next frame the iterator yields
        self._needed = needed  # source frames this job uses (None: all); others are skipped
        self.shape: Optional[tuple] = None
        self.dtype: Optional[torch.dtype] = None

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
            frame = source_frame(raw, self._next)
            if self.shape is None:
                self.shape, self.dtype = tuple(frame.shape), frame.dtype
            elif tuple(frame.shape) != self.shape:
                raise InputError(f"frame {self._next} has shape {tuple(frame.shape)} but frame 0 "
                                 f"has {self.shape}: all frames must have the same size and channels")
            elif frame.dtype != self.dtype:
                raise InputError(f"frame {self._next} is {frame.dtype} but frame 0 is "
                                 f"{self.dtype}: all frames must have the same precision")
            self._cache[self._next] = frame.pin_memory() if self._pin else frame
            self._next += 1

    def get(self, start: int, stop: int) -> list[torch.Tensor]:
        """Plan frames [start, stop), each (H, W, C) in its source precision."""
        indices = [self._plan.source_index(i) for i in range(start, stop)]
        self._pull(max(indices))
        return [self._cache[i] for i in indices]

    def release_before(self, plan_frame: int):
        """Frames no batch starting at or after ``plan_frame`` can need are dropped."""
        keep_from = self._plan.source_start(plan_frame)
        for i in [i for i in self._cache if i < keep_from]:
            del self._cache[i]


@dataclass
class Encoded:
    batch: Batch
    latent: torch.Tensor  # (t, h, w, 16) scaled, channels-last
    # (n, H, W, C) input frames in their source precision on the VAE's device: the colour
    # reference and alpha are remade from them at decode (far smaller than a float32 reference).
    source: torch.Tensor
    size: tuple  # output (H, W)
    result: Optional[torch.Tensor] = None  # x0 latent, then decoded frames


# On CUDA a stop check waits for the work queued this many checks ago: else the host runs a whole
# launch queue (a DiT forward, a VAE pass) ahead, and a Cancel waits for all of it.
CHECKS_IN_FLIGHT = 2


class StopPoints:
    """Where a running phase reads the stop flag (docs/comfyui.md#progress-and-cancel): forward
    pre-hooks registered for the job and the tiling's ``between`` callback (``models/`` stays pure
    torch). Hooks run in ``Module.__call__``, outside what torch.compile replaces
    (``memory.compile``: per DiT block, the VAE's encoder/decoder whole), so a compiled VAE gets no
    hooks inside (they would break its graph). On CUDA each check waits for the event of the one
    ``CHECKS_IN_FLIGHT`` checks back, never a device- or stream-wide sync."""

    def __init__(self, should_stop: Callable[[], bool]):
        self.should_stop = should_stop
        self._queued: dict = {}  # device -> deque of events, one per check (CUDA only)
        self._lock = threading.Lock()  # the encoding thread checks too
        self._abandoned = threading.Event()

    def abandon(self):
        """Stop at the next check whatever ``should_stop`` says: the job is being left (an
        error, Ctrl-C), and a thread still encoding must not run on to its batch's end."""
        self._abandoned.set()

    def __call__(self, device: Optional[torch.device] = None):
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            with self._lock:
                queued = self._queued.setdefault(device, deque())
                queued.append(event)
                oldest = queued.popleft() if len(queued) > CHECKS_IN_FLIGHT else None
            if oldest is not None:
                oldest.synchronize()
        if self._abandoned.is_set() or self.should_stop():
            raise Interrupted("upscaling interrupted")

    def _hook(self, module, args):
        first = args[0] if args else None
        self(first.device if isinstance(first, torch.Tensor) else None)

    def attach(self, models: Models) -> list:
        """Register the checks on the models; returns the handles (``remove()`` each)."""
        handles = []
        dit = models.dit
        # Sequence parallelism: a group's ranks meet in collectives inside every block; one leaving
        # mid-forward would strand the others, so they stop between batches, together.
        if getattr(dit, "sequence_parallel", None) is None:
            handles += [block.register_forward_pre_hook(self._hook) for block in dit.blocks]
        vae = models.vae
        for half in (vae.encoder, vae.decoder):
            if is_compiled(half):
                continue
            handles += [m.register_forward_pre_hook(self._hook) for m in half.modules()]
        return handles


class Upscaler:
    """Runs a batch plan over a frame stream with loaded models."""

    def __init__(self, models: Models, opts: Options, progress: Optional[Progress] = None,
                 should_stop: Optional[Callable[[], bool]] = None, *,
                 stats: Optional[JobStats] = None, frames_on_device: bool = False):
        self.models, self.opts, self.dtype = models, opts, models.dtype
        self.progress = progress or (lambda phase, done, total: None)
        self.should_stop = should_stop or (lambda: False)
        # Latents and frames wait here between phases ("none": on the device that made them).
        self.offload = torch.device(opts.tensor_offload_device) \
            if opts.tensor_offload_device != "none" else models.vae_device
        self.encode_tiles, self.encode_slice = tiling.settings_from_options(opts, "encode")
        self.decode_tiles, self.decode_slice = tiling.settings_from_options(opts, "decode")
        self.stats = stats if stats is not None else JobStats()  # this job's, recorded as it runs
        # A file job rounds frames to integers on the device: a 4x / 2x smaller copy to the host.
        self.frames_on_device = frames_on_device
        # DiT and VAE on different devices: encoding runs a chunk ahead on a thread, same results.
        self.overlap_phases = models.dit_device != models.vae_device
        self._pending_times: list = []  # (phase, start event, end event) not yet read
        self._clock_lock = threading.Lock()
        self._vae_lock = threading.Lock()  # encoding (maybe on a thread) and decoding: one at a time
        self._text: dict = {}  # device -> the text embedding there, uploaded once per job
        self._stops = StopPoints(self.should_stop)
        if isinstance(opts.batch_size, int):
            self.stats.batch_size = opts.batch_size

    def _vae_between(self):
        self._stops(self.models.vae_device)

    def _upload_frames(self, frames: list, device: torch.device) -> torch.Tensor:
        """(n, H, W, C) on ``device`` in the frames' source precision; from pinned frames each
        copy is non-blocking (see :func:`~seedvr2.models.window.to_device`)."""
        if device.type == "cpu":
            return torch.stack(frames)
        out = torch.empty((len(frames), *frames[0].shape), dtype=frames[0].dtype, device=device)
        for i, frame in enumerate(frames):
            out[i].copy_(frame, non_blocking=frame.is_pinned())
        return out

    def _reference(self, source: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """(n, 3, H', W') RGB of the source frames resized to the output, in [0, 1]."""
        x = unit_float(source).permute(0, 3, 1, 2)  # (n, C, H, W)
        rgb = x[:, :3] if x.shape[1] >= 3 else x.expand(-1, 3, -1, -1)
        return F.interpolate(rgb, size=size, mode="bicubic", antialias=True,
                             align_corners=False).clamp_(0, 1)

    def _encode(self, batch: Batch, frames: list, size: tuple[int, int]) -> Encoded:
        opts, vae, device = self.opts, self.models.vae, self.models.vae_device
        source = self._upload_frames(frames, device)
        reference = self._reference(source, size) * 2 - 1
        pad_h, pad_w = (-n % MODEL_MULTIPLE for n in size)
        video = F.pad(reference, (0, pad_w, 0, pad_h), mode="replicate") if pad_h or pad_w else reference
        del reference
        if batch.length > batch.frames:  # repeat the last frame up to 4n+1
            video = torch.cat([video, video[-1:].expand(batch.length - batch.frames, -1, -1, -1)])
        video = video.permute(1, 0, 2, 3)[None]  # (1, 3, T, H, W)
        if opts.input_noise_scale > 0:
            noise = _randn(video.shape, batch_seed(opts.seed, batch.start, INPUT_NOISE), device)
            video = video + 0.025 * opts.input_noise_scale * noise
        mean, logvar = tiling.encode_posterior(vae, video.to(self.dtype), self.encode_tiles,
                                              self.encode_slice, self._vae_between)
        eps = _randn(mean.shape, batch_seed(opts.seed, batch.start, EPS), device, mean.dtype)
        latent = vae.sample_posterior(mean, logvar, noise=eps)
        check_finite(latent, "VAE encoder", self.dtype, _batch_name(batch))
        latent = (latent[0].permute(1, 2, 3, 0).float() * LATENT_SCALE).to(self.offload)
        return Encoded(batch, latent, source, size)

    def _text_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._text:
            self._text[device] = to_device(self.models.text, device).to(self.dtype)
        return self._text[device]

    def _denoise(self, item: Encoded):
        opts, dit, device = self.opts, self.models.dit, self.models.dit_device
        latent = item.latent.to(device)
        seed = lambda purpose: batch_seed(opts.seed, item.batch.start, purpose)  # noqa: E731
        noise = _randn(latent.shape, seed(NOISE), device)
        if opts.latent_noise_scale > 0:
            latent = augment_latent(latent, _randn(latent.shape, seed(AUG_NOISE), device),
                                    opts.latent_noise_scale)
        vid = dit_input(noise, make_condition(latent))
        t, h, w, _ = vid.shape
        text = self._text_on(device)
        # Shapes stay on the CPU (the DiT reads them as Python numbers: on the device that
        # would be a copy there and a sync back); the timestep is filled on the device.
        v = dit(vid.reshape(-1, vid.shape[-1]).to(self.dtype), text,
                torch.tensor([[t, h, w]]), torch.tensor([[text.shape[0]]]),
                torch.full((1,), T, device=device))
        check_finite(v, "DiT", self.dtype, _batch_name(item.batch))
        item.result = x0_from_velocity(noise, v.float().reshape(noise.shape)).to(self.offload)
        item.latent = None

    def _decode(self, item: Encoded) -> torch.Tensor:
        device, size = self.models.vae_device, item.size
        z = (item.result.to(device) / LATENT_SCALE).permute(3, 0, 1, 2)[None]
        video = tiling.decode(self.models.vae, z.to(self.dtype), self.decode_tiles,
                              self.decode_slice, self._vae_between)  # (1, 3, T, H16, W16)
        check_finite(video, "VAE decoder", self.dtype, _batch_name(item.batch))
        item.result = None
        n = item.batch.frames
        frames = video[0, :, :n, : size[0], : size[1]].permute(1, 0, 2, 3).float()  # (n, 3, H, W)
        del video
        return self._finish(item, frames)

    def _finish(self, item: Encoded, frames: torch.Tensor) -> torch.Tensor:
        """Colour correction against the resized input, gray or alpha put back."""
        device, method = self.models.vae_device, self.opts.color_correction
        self._stops(device)
        if method != "none":
            frames = color_correct(frames, self._reference(item.source, item.size) * 2 - 1, method)
            self._stops(device)
        rgb = ((frames.clamp(-1, 1) + 1) / 2)
        channels = item.source.shape[-1]
        if channels == 1:
            out = (rgb * to_device(_LUMA, rgb.device)[None, :, None, None]).sum(1, keepdim=True)
        elif channels == 4:
            alpha = unit_float(item.source[..., 3:4]).permute(0, 3, 1, 2)
            out = torch.cat([rgb, upscale_alpha(alpha, rgb)], dim=1)
        else:
            out = rgb
        item.source = None
        return out.permute(0, 2, 3, 1).to(device if self.frames_on_device else self.offload)

    @contextmanager
    def _phase(self, phase: str):
        """Time and memory peaks of one phase call. On CUDA the time is two events read later
        (:meth:`_collect_times`): a host sync per phase would let the device run dry."""
        device = self.models.dit_device if phase == "dit" else self.models.vae_device
        cuda = device.type == "cuda"
        start = None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(device))
        began = time.perf_counter()
        try:
            yield
        finally:
            with self._clock_lock:
                if cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(torch.cuda.current_stream(device))
                    self._pending_times.append((phase, start, end))
                else:
                    self.stats.add(phase, time.perf_counter() - began)
                # The allocator's counters are host-side: reading them waits for nothing.
                self.stats.record_memory(
                    phase, torch.cuda.max_memory_allocated(device) if cuda else None,
                    torch.cuda.max_memory_reserved(device) if cuda else None, host_rss())

    def _collect_times(self, wait: bool = False):
        """Add the CUDA phase times whose end events have completed (``wait``: all of them)."""
        with self._clock_lock:
            while self._pending_times:
                phase, start, end = self._pending_times[0]
                if wait:
                    end.synchronize()
                elif not end.query():
                    break
                self.stats.add(phase, start.elapsed_time(end) / 1000)
                self._pending_times.pop(0)

    def _encoded(self, batches: list, plan: BatchPlan, source: FrameSource) -> Iterator[Encoded]:
        """The batches encoded, in order (on a thread of its own when the phases overlap:
        inference mode is per thread, hence entered here)."""
        with torch.inference_mode():
            size = None
            for i in batches:
                self._stops()
                b = plan.batches[i]
                raw = source.get(b.start, b.stop)
                size = size or output_size(raw[0].shape[0], raw[0].shape[1], self.opts)
                with self._vae_lock, self._phase("encode"):
                    item = self._encode(b, raw, size)
                del raw
                source.release_before(plan.batches[i + 1].start if i + 1 < len(plan.batches)
                                      else plan.plan_frames)
                yield item

    @torch.inference_mode()
    def batch_outputs(self, frames: Iterable, plan: BatchPlan,
                      batches: Optional[Sequence[int]] = None) -> Iterator[tuple[Batch, torch.Tensor]]:
        """Decoded, colour-corrected frames (n, H, W, C) of each batch, unblended, in plan order.
        ``batches`` (contiguous, ascending) restricts the job to a share of the plan; ``frames``
        must then start at :meth:`BatchPlan.read_start` of them. With the phases overlapping both
        models stay active and the next chunk is encoded on a thread while the DiT runs."""
        chosen = list(range(len(plan.batches))) if batches is None else list(batches)
        needed = None if batches is None else {
            plan.source_index(f) for i in chosen for f in range(plan.batches[i].start, plan.batches[i].stop)}
        wanted = set(chosen)
        chunks = [c for c in ([i for i in chunk if i in wanted] for chunk in plan.chunks) if c]
        self._stops = StopPoints(self.should_stop)
        reader = ReadAhead(frames, max(b.frames for b in plan.batches))  # one batch ahead
        source = FrameSource(reader, plan, plan.read_start(chosen), needed,
                             pin=self.models.vae_device.type == "cuda")
        encoded = self._encoded([i for chunk in chunks for i in chunk], plan, source)
        hooks, finished = [], Counter()

        def done(phase: str):  # batches finished per phase, told to progress
            finished[phase] += 1
            self.progress(phase, finished[phase], len(chosen))
        try:
            hooks = self._stops.attach(self.models)
            if self.overlap_phases:
                self.models.activate("vae")
                self.models.activate("dit")
                encoded = ReadAhead(encoded, max(len(c) for c in chunks))
            for chunk in chunks:
                yield from self._chunk_outputs(chunk, encoded, done)
        finally:
            # Also after an error or interrupt: nothing stays on the device, no thread runs on.
            self._stops.abandon()
            encoded.close()
            reader.close()
            self._wind_down(hooks)

    def _chunk_outputs(self, chunk: list[int], encoded, done: Callable[[str], None]):
        """One chunk's phases: encode every batch, the DiT on each (as each is encoded when
        the phases overlap), decode each."""
        overlap = self.overlap_phases
        items = []
        if not overlap:
            self.models.activate("vae")
        for _ in chunk:
            items.append(next(encoded))
            done("encode")
            if overlap:
                self._denoise_counted(items[-1], done)
        if not overlap:
            self.models.park("vae")
            self.models.activate("dit")
            for item in items:
                self._denoise_counted(item, done)
            self.models.park("dit")
            self.models.activate("vae")
        for item in items:
            self._stops()
            with self._vae_lock, self._phase("decode"):
                out = self._decode(item)
            done("decode")
            yield item.batch, out
            del out
            self._collect_times()  # the consumer has fetched the frames: these ended

    def _denoise_counted(self, item: Encoded, done: Callable[[str], None]):
        self._stops()
        with self._phase("dit"):
            self._denoise(item)
        done("dit")

    def _wind_down(self, hooks: list):
        for hook in hooks:
            hook.remove()
        self.models.park("dit")
        self.models.park("vae")
        self._collect_times(wait=True)
        for name, phase in self.stats.phases.items():
            log.debug("phase %s: %s", name, phase.describe(f"{phase.calls} call(s)"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def check_stop(self):
        """Raises :class:`Interrupted` once ``should_stop`` says so."""
        self._stops()

    def run(self, frames: Iterable, plan: BatchPlan,
            preview=None) -> Iterator[tuple[int, torch.Tensor]]:
        """Yields (first source frame, frames (n, H, W, C) float32 in [0, 1]) in order, one
        frame at a time (:func:`final_frames`, which shows each to ``preview``)."""
        return final_frames(plan, self.batch_outputs(frames, plan), self.progress, self.stats,
                            self.check_stop, preview)


def final_frames(plan: BatchPlan, outputs, progress: Optional[Progress] = None,
                 stats: Optional[JobStats] = None, check_stop=None, preview=None):
    """Each batch's ``outputs`` (in plan order) blended into final frames, yielded one at a time
    as (first source frame, frames): ``check_stop`` runs before each, so a Cancel while the consumer
    writes waits for one frame, not a batch; ``progress``, ``stats`` and ``preview`` see each."""
    blender = OverlapBlender(plan)
    for batch, out in outputs:
        for first, final in blender.add(batch, out):
            for k in range(final.shape[0]):
                done = blender.emitted - final.shape[0] + k + 1
                if check_stop is not None:
                    check_stop()
                if stats is not None:
                    stats.frames = done
                yield first + k, final[k:k + 1]
                if progress is not None:
                    progress("frames", done, plan.source_frames)
                if preview is not None:
                    preview(final[k:k + 1])


class OverlapBlender:
    """Per-batch outputs, in plan order, into final frames: each overlap cross-faded, the
    prepended frames dropped. One process and the writer rank of many both blend through it."""

    def __init__(self, plan: BatchPlan):
        self.plan = plan
        self.pending: Optional[torch.Tensor] = None  # previous batch's frames not yet final
        self.emitted = 0

    def add(self, b: Batch, out: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        plan = self.plan
        if b.overlap and self.pending is not None:
            # The weights go where the frames are (a file job keeps them on the GPU).
            w = to_device(blend_weights(b.overlap), out.device)[:, None, None, None]
            out = torch.cat([self.pending * (1 - w) + out[: b.overlap] * w, out[b.overlap:]])
        final_stop = plan.emit_stop(b)
        self.pending = out[final_stop - b.start:]
        first = max(b.start, plan.prepend)
        if first < final_stop:
            final = out[first - b.start: final_stop - b.start]
            self.emitted += final.shape[0]
            yield first - plan.prepend, final
