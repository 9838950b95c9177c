"""Memory budget: what a job needs on each device, known before any frame is processed.

:func:`estimate` (pure, from the model configurations alone) gives per phase (VAE encode, DiT, VAE
decode) and device the resident weights plus activations; :func:`check` raises one
:class:`BudgetError` naming settings that would fit; :func:`auto_batch_size` picks the largest 4n+1
batch that fits. The activation model and its CUDA margins: docs/memory.md."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import SeedVR2Error
from ..loading.format_table import bytes_per_weight
from ..models import build_on_meta
from ..models.config import DiTConfig, VAEConfig
from ..models.vae_blocks import SPLIT_ELEMENTS
from ..options import option_ref
from .blockswap import BlockSwap
from .placement import named_tensors
from .tiling import TILE_MULTIPLE, TileSettings, tile_layout

GIB = 1 << 30
MIB = 1 << 20
ACTIVATION_MARGIN = 0.10  # share of the activations added for allocator rounding/fragmentation
FIXED_OVERHEAD = 256 * MIB  # per device and phase off CUDA: kernels' scratch, allocator rounding
CUDA_FIXED_OVERHEAD = 3 * GIB // 2  # per CUDA device and phase: cuDNN/cuBLAS workspaces, rounding
AUTO_CUDA_SHARE = 0.85  # batch_size auto fills at most this share of a CUDA device's free memory
# Reduces the fragmentation the estimate cannot model; named in every CUDA shortfall message.
EXPANDABLE_SEGMENTS = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
AUTO_MIN_BATCH = 5  # auto keeps temporal context: never fewer frames per batch when any fit
# The DiT's window rule sizes windows from min(t, 30) latent frames; past t = 30 (117 video
# frames) a batch gains no longer windows, so 'auto' stops there.
AUTO_MAX_BATCH = 4 * 29 + 1
TEXT_TOKENS = 58  # rows of the released positive text embedding (pos_emb.pt)

log = logging.getLogger("seedvr2")

_DIT_IO = BlockSwap.INPUT_MODULES + BlockSwap.OUTPUT_MODULES  # what swap_io_components moves


class BudgetError(SeedVR2Error, ValueError):
    """A job that will not fit the memory available; the message names settings that would."""


def fixed_overhead(device: str) -> int:
    """Bytes per phase on ``device`` that do not scale with the job (docs/memory.md)."""
    return CUDA_FIXED_OVERHEAD if device.startswith("cuda") else FIXED_OVERHEAD


def gib(n: float) -> str:
    """A size for messages: GiB with one decimal, MiB under 1 GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


# == Weights

@dataclass(frozen=True)
class Weights:
    """Bytes of one model's tensors in memory, split the way BlockSwap moves them: each DiT block
    (none for the VAE), the DiT's input and output layers, everything else. ``largest_layer``:
    parameters of the largest linear/conv weight (packed weights are dequantised a layer at a time:
    one such layer in the compute dtype is transient extra)."""

    blocks: tuple[int, ...] = ()
    io: int = 0
    other: int = 0
    largest_layer: int = 0

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.io + self.other

    def resident(self, blocks_to_swap: int = 0, swap_io: bool = False) -> int:
        """Bytes on the compute device while the model runs with BlockSwap as given."""
        n = min(blocks_to_swap, len(self.blocks))
        swapped = list(self.blocks[:n]) + ([self.io] if swap_io and self.io else [])
        in_flight = sum(sorted(swapped, reverse=True)[:2])  # running unit + prefetched next
        return self.total - sum(swapped) + in_flight

    @classmethod
    def _from_sizes(cls, sizes: Sequence[tuple[str, int]], largest: int) -> "Weights":
        blocks: dict[int, int] = {}
        io = other = 0
        for name, nbytes in sizes:
            parts = name.split(".")
            if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
                blocks[int(parts[1])] = blocks.get(int(parts[1]), 0) + nbytes
            elif parts[0] in _DIT_IO:
                io += nbytes
            else:
                other += nbytes
        ordered = tuple(blocks.get(i, 0) for i in range(max(blocks) + 1)) if blocks else ()
        return cls(ordered, io, other, largest)

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> "Weights":
        """Exact sizes of a loaded model (packed weights as stored, shared tensors once)."""
        unique: dict = {}
        for name, t in named_tensors(module):
            unique.setdefault(_storage_key(t), (name, t.numel() * t.element_size()))
        return cls._from_sizes(list(unique.values()), _largest_layer(module))

    @classmethod
    def from_config(cls, kind: str, config, bytes_per_param: float) -> "Weights":
        """Sizes of a model built on ``meta`` from ``config`` (DiT or VAE), every parameter
        stored at ``bytes_per_param`` (:func:`~seedvr2.loading.packed.bytes_per_weight`)."""
        model = build_on_meta(kind, config)
        sizes = [(name, math.ceil(t.numel() * bytes_per_param)) for name, t in named_tensors(model)]
        return cls._from_sizes(sizes, _largest_layer(model))

    @classmethod
    def from_file(cls, path, kind: str, dtype: torch.dtype) -> tuple["Weights", object]:
        """(sizes, config) of a weight file in ``dtype`` (packed: as stored), from its header."""
        from ..loading.load import EMBEDDED_TEXT_KEYS, config_for  # the loader's detection
        from ..loading.weight_files import open_weights

        with open_weights(path) as src:
            config = config_for(src, kind)
            sizes = []
            for key, shape in src.shapes.items():
                if key in EMBEDDED_TEXT_KEYS:  # text embeddings stay on the CPU
                    continue
                numel = math.prod(shape)
                label = src.packed.get(key)
                per = (bytes_per_weight(label) or 1.0) if label is not None else \
                    4 if key.endswith("rope.rope.freqs") else torch.empty((), dtype=dtype).element_size()
                sizes.append((key, math.ceil(numel * per)))
        return cls._from_sizes(sizes, _largest_layer(build_on_meta(kind, config))), config


def _storage_key(t: torch.Tensor):
    """Tensors with one key hold the same bytes. By the view's own address, not its
    storage's: an offloaded model's tensors are views of one host arena (memory.arena).
    Tensors without memory (``meta``; the fake tensors of a rehearsal, whose addresses all
    read 0) by their object: shared tensors are one object."""
    if t.device.type == "meta" or is_fake(t):
        return id(t)
    return (t.device, t.data_ptr(), t.nbytes)


def _largest_layer(module: torch.nn.Module) -> int:
    largest = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            largest = max(largest, m.in_features * m.out_features)
        elif isinstance(m, torch.nn.modules.conv._ConvNd):
            largest = max(largest, m.out_channels * m.in_channels // m.groups
                          * math.prod(m.kernel_size))
    return largest


def bytes_on(module: Optional[torch.nn.Module], device: torch.device) -> int:
    """Bytes of ``module``'s tensors that are on ``device`` now (each storage once)."""
    if module is None:
        return 0
    device = torch.device(device)
    held: dict = {}  # memory held, so each storage once (an offloaded model's arena is one)
    for _, t in named_tensors(module):
        if t.device.type == device.type and device.index in (None, t.device.index):
            key = id(t) if t.device.type == "meta" else t.untyped_storage()._cdata \
                if is_fake(t) else t.untyped_storage().data_ptr()  # (a fake one's reads 0)
            held.setdefault(key, t.untyped_storage().nbytes())
    return sum(held.values())


# == The job and where things run

@dataclass(frozen=True)
class BatchShape:
    """One batch of the job: output frame size, frames per batch, precision, VAE tiling;
    ``chunk_size``: the option when a chunk's tensors wait on the compute device between
    phases (tensor_offload_device none or that device), else None (the default)."""

    height: int
    width: int
    batch_size: int
    dtype_bytes: int = 2
    text_tokens: int = TEXT_TOKENS
    encode_tiles: TileSettings = field(default_factory=TileSettings)
    decode_tiles: TileSettings = field(default_factory=TileSettings)
    chunk_size: Optional[int] = None
    encode_slice: Optional[int] = None  # VAE causal temporal slice (video frames), None = whole
    decode_slice: Optional[int] = None
    color_correction: str = "wavelet"  # the option: what colour correction holds after decode
    vae_int8_cache: str = "off"  # the option: the VAE's large causal tails in int8 (off/on/host)

    @property
    def padded(self) -> tuple[int, int]:
        return -(-self.height // 16) * 16, -(-self.width // 16) * 16


@dataclass(frozen=True)
class Placement:
    """Model devices (cuda:0), where each waits while the other runs (None: stays), BlockSwap."""

    dit_device: str = "cuda:0"
    vae_device: str = "cuda:0"
    dit_offload: Optional[str] = None
    vae_offload: Optional[str] = None
    blocks_to_swap: int = 0
    swap_io: bool = False

    @property
    def swapping(self) -> bool:
        return self.blocks_to_swap > 0 or self.swap_io

    @property
    def host_only(self) -> bool:
        """Both models compute on the CPU: offloading to it frees nothing."""
        return self.dit_device == "cpu" and self.vae_device == "cpu"

    @property
    def one_accelerator(self) -> bool:
        """Both models on one device that is not the CPU: offloading either frees room there."""
        return self.dit_device == self.vae_device != "cpu"


@dataclass(frozen=True)
class Budget:
    """The models a job runs: configs and weight sizes."""

    dit: DiTConfig
    vae: VAEConfig
    dit_weights: Weights
    vae_weights: Weights


# == Activations

# Calibration on the real-size trace (bench/memory_trace.py): the tensors below are what one
# block holds at its peak; the trace of the whole forward (window layouts, RoPE tables, the
# attention output and log-sum-exp of fused kernels) is up to 8 % more at 2160p.
_DIT_SCALE = 1.1


def dit_activation_bytes(cfg: DiTConfig, shape: BatchShape) -> int:
    """Peak bytes of one DiT call on a batch (docs/memory.md, "How the estimate is made")."""
    b = shape.dtype_bytes
    hp, wp = shape.padded
    t = (shape.batch_size - 1) // 4 + 1
    positions = t * (hp // 8) * (wp // 8)
    tokens = positions // 4
    d, inner, hidden = cfg.vid_dim, cfg.heads * cfg.head_dim, cfg.mlp_hidden_dim
    mlp = b * (4 * d + (3 if cfg.mlp_type == "swiglu" else 2) * hidden)
    qk_fp32 = b * (2 * d + 6 * inner) + 16 * inner
    windows = b * (2 * d + 14 * inner)
    per_token = max(mlp, qk_fp32, windows) + 8 * cfg.head_dim + 128
    inputs = positions * (4 * (16 + 16 + 17 + 33 + 16) + b * 33)
    text = shape.text_tokens * (cfg.txt_in_dim + 8 * d) * max(b, 4)
    return int((tokens * per_token + inputs + text) * _DIT_SCALE)


def _resnet_peak(c_hold: int, c_in: int, c_out: int, layers: int, frames: int, b: int) -> float:
    """Peak bytes per voxel of a block of ``layers`` residual blocks (c_in -> c_out) whose
    input (``c_hold`` channels) is also held by the caller."""
    pad = 1 + 2 / frames
    up = (4 / b) if b < 4 else 0.0  # FrameGroupNorm's float32 copy, in units of b
    peak = 0.0
    for j in range(layers):
        cx = c_in if j == 0 else c_out
        base = cx + (c_hold if j > 0 else 0)
        moments = [base + cx * pad + cx * up, base + cx * pad + c_out,
                   base + c_out + c_out * pad + c_out * up, base + 2 * c_out + c_out * pad]
        if cx != c_out:
            moments.append(base + 3 * c_out)  # h, shortcut
        peak = max(peak, max(moments))
    return peak * b


def _mid_peak(c: int, frames: int, b: int) -> float:
    """Peak bytes per voxel of the mid block: attention (x, tokens, q, k, v, out, sum) or resnet."""
    up = (4 / b) if b < 4 else 0.0
    return max(b * (2 * c + 5 * c + c * up), _resnet_peak(c, c, c, 2, frames, b))


def vae_encode_bytes(cfg: VAEConfig, frames: int, height: int, width: int, b: int) -> int:
    """Peak bytes of the VAE encoder's own tensors on a ``frames x height x width`` input."""
    from ..models.vae_blocks import down_kinds

    widths = cfg.block_out_channels
    kinds = down_kinds(len(widths), cfg.temporal_scale_num)
    t, h, w = frames, height, width
    peak, c_in = 0.0, widths[0]
    for i, c_out in enumerate(widths):
        voxels = t * h * w
        peak = max(peak, voxels * _resnet_peak(c_in, c_in, c_out, cfg.layers_per_block, t, b))
        if kinds[i] is not None:
            h, w = -(-h // 2), -(-w // 2)
            if kinds[i] == "time":
                t = (t - 1) // 2 + 1
        c_in = c_out
    return int(max(peak, t * h * w * _mid_peak(widths[-1], t, b)))


def vae_decode_bytes(cfg: VAEConfig, frames: int, height: int, width: int, b: int) -> int:
    """Peak bytes of the VAE decoder's own tensors producing ``frames x height x width``."""
    from ..models.vae_blocks import up_kinds

    widths = list(reversed(cfg.block_out_channels))
    kinds = up_kinds(len(widths), cfg.temporal_scale_num)
    s = cfg.spatial_downsample_factor
    t, h, w = (frames - 1) // cfg.temporal_downsample_factor + 1, height // s, width // s
    peak = t * h * w * _mid_peak(widths[0], t, b)
    c_in = widths[0]
    for i, c_out in enumerate(widths):
        voxels = t * h * w
        peak = max(peak, voxels * _resnet_peak(c_in, c_in, c_out, cfg.layers_per_block + 1, t, b))
        if kinds[i] is not None:
            r = 4 * (2 if kinds[i] == "time" else 1)
            t2 = 2 * t - 1 if kinds[i] == "time" else t
            h, w = 2 * h, 2 * w
            # caller's input, block output, the 1x1 conv's r*C channels, the padded buffer
            up = b * voxels * (c_in + c_out + r * c_out) + b * t2 * h * w * c_out * (1 + 2 / t2)
            peak = max(peak, up)
            t = t2
        c_in = c_out
    return int(peak)


# Calibration on the real-size trace (docs/memory.md, "How the estimate is made"): the model above
# is scaled per size class of one piece's full-resolution planes (channels x frames x pixels):
# <= SPLIT_ELEMENTS / 4 (a tile), <= SPLIT_ELEMENTS, more.
_SPLIT = SPLIT_ELEMENTS  # the real limit the calibration was traced with (tests lower the
# module attribute; the size classes stay those of the code as shipped)
_CORE_SCALE = ((_SPLIT // 4, (0.95, 0.97)), (_SPLIT, (0.88, 0.64)), (None, (0.74, 0.58)))
# Traced against _causal_cache_bytes, the tails a temporal slice carries: (encode, decode).
_CACHE_SCALE = (0.50, 1.18)


# After decoding: the frames in float32 (12 bytes), the decoded video, and what colour
# correction adds per pixel (traced on fake tensors: wavelet 48, lab 56, here 4 more; hsv and
# wavelet_adaptive branch on values, untraceable without data: 16 float32 frames).
_COLOUR_BYTES = {"none": 0, "wavelet": 52, "lab": 60, "adain": 60, "hsv": 192,
                 "wavelet_adaptive": 192}


def _core_scale(cfg: VAEConfig, frames: int, height: int, width: int, decode: bool) -> float:
    plane = cfg.block_out_channels[0] * frames * height * width
    return next(scales[decode] for limit, scales in _CORE_SCALE if limit is None or plane <= limit)


def _causal_cache_bytes(cfg: VAEConfig, height: int, width: int, b: int,
                        int8_cache: str = "off") -> int:
    """Frames a temporal slice carries on (two per causal 3x3x3 conv), at each level's width
    and resolution. ``int8_cache`` (vae_int8_cache): tails from ``INT8_CACHE_BYTES`` on at a
    byte per value; ``host``: parked off the device but the one read and the one fetched."""
    from ..models.vae_paths import INT8_CACHE_BYTES

    convs_per_level = 2 * (cfg.layers_per_block + 1) + 2
    total, in_flight, h, w = 0, 0, height, width
    for c in cfg.block_out_channels:
        tail = 2 * c * h * w * b
        if int8_cache != "off" and tail >= INT8_CACHE_BYTES:
            tail //= b
            if int8_cache == "host":
                in_flight, tail = max(in_flight, 2 * tail), 0
        total += convs_per_level * tail
        h, w = -(-h // 2), -(-w // 2)
    return total + in_flight


def _laid_tile(pixels: int, tiles: TileSettings) -> int:
    """The edge of the tiles laid along ``pixels`` (as ``tiling.tile_layout``; exact: the size)."""
    if getattr(tiles, "exact", False):
        return tiles.tile_size
    m = TILE_MULTIPLE
    return tile_layout(pixels // m, tiles.tile_size // m, tiles.tile_overlap // m)[1] * m


def _vae_phase(cfg: VAEConfig, shape: BatchShape, decode: bool) -> int:
    """Activations of one VAE phase on a batch: the encoder/decoder's peak on one piece (a
    tile with its context, a temporal slice) plus the frame buffers held meanwhile."""
    b = shape.dtype_bytes
    hp, wp = shape.padded
    frames = shape.batch_size
    tiles = shape.decode_tiles if decode else shape.encode_tiles
    temporal = shape.decode_slice if decode else shape.encode_slice
    context = getattr(tiles, "context", 0)  # pixels computed around a tile and discarded
    th, tw = (min(_laid_tile(n, tiles) + 2 * context, n) for n in (hp, wp)) \
        if tiles.enabled else (hp, wp)
    piece = min(frames, 1 + temporal) if temporal else frames
    cache = _causal_cache_bytes(cfg, th, tw, b, shape.vae_int8_cache) if piece < frames else 0
    pieced = piece < frames or (th, tw) != (hp, wp)
    pixels = frames * hp * wp
    # Exact tiling with its frame-wide planes on the VAE's device: a layer's input and output
    # over the whole frame, at the widest full-resolution layer, in float32.
    planes_here = tiles.enabled and getattr(tiles, "exact", False) \
        and getattr(tiles, "state_device", "cpu") is None
    widths = cfg.block_out_channels
    pixels_planes = pixels * 4 * (widths[0] + widths[min(1, len(widths) - 1)]) if planes_here else 0
    scale = _core_scale(cfg, piece, th, tw, decode)
    cache = int(cache * _CACHE_SCALE[decode])
    # Bytes per output pixel and frame the pipeline holds around the VAE, with ``b`` bytes per
    # value of the model dtype: while encoding, the resized video (float32, 12) and its copy in
    # the model dtype; while decoding in pieces, the output the pieces are blended into (traced
    # at b = 2: 19 and 8 bytes, here rounded up to 20 and 9) and one piece's float32 blend.
    if decode:
        core = int(vae_decode_bytes(cfg, piece, th, tw, b) * scale) + cache
        held = pixels * (3 + 3 * b) + piece * th * tw * 3 * 8 if pieced else 0
        after = pixels * (12 + 3 * b + _COLOUR_BYTES.get(shape.color_correction, 192))
        return max(core + held + pixels_planes, after)
    core = int(vae_encode_bytes(cfg, piece, th, tw, b) * scale) + cache
    return core + pixels * (14 + 3 * b) + pixels_planes


# == The estimate

@dataclass(frozen=True)
class PhaseNeed:
    """Bytes one phase needs on one device, by part (label, bytes)."""

    phase: str  # "encode", "DiT", "decode"
    device: str
    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.parts)

    def describe(self) -> str:
        return ", ".join(f"{label} {gib(n)}" for label, n in self.parts if n)


@dataclass(frozen=True)
class Estimate:
    phases: tuple[PhaseNeed, ...]

    def peak(self, device: str) -> int:
        return max((p.total for p in self.phases if p.device == device), default=0)

    def worst(self, device: str) -> Optional[PhaseNeed]:
        on = [p for p in self.phases if p.device == device]
        return max(on, key=lambda p: p.total) if on else None

    @property
    def devices(self) -> list[str]:
        return list(dict.fromkeys(p.device for p in self.phases))


def estimate(budget: Budget, shape: BatchShape, place: Placement) -> Estimate:
    """Bytes each phase needs on each device it touches (weights, activations, margins)."""
    dw, vw = budget.dit_weights, budget.vae_weights
    b = shape.dtype_bytes
    hp, wp = shape.padded
    # Latents, references and results of a chunk (at most chunk_size new frames, at least a
    # batch, plus the overlap) waiting on the compute device.
    frames = max(shape.chunk_size, shape.batch_size) + shape.batch_size if shape.chunk_size is not None else 0
    waiting = frames * hp * wp * (12 + 2)

    def parked_dit(device: str) -> int:  # the DiT while a VAE phase runs on ``device``
        stays = place.dit_device == device and not place.swapping and place.dit_offload is None
        return dw.total if stays else 0

    def parked_vae(device: str) -> int:
        return vw.total if place.vae_device == device and place.vae_offload is None else 0

    def need(phase: str, device: str, weights: list, activations: int) -> PhaseNeed:
        parts = [*weights, ("activations", activations),
                 ("margin", int(activations * ACTIVATION_MARGIN) + fixed_overhead(device))]
        if waiting:
            parts.append(("waiting tensors", waiting))
        return PhaseNeed(phase, device, tuple(parts))

    vae_transient = vw.largest_layer * b
    enc = _vae_phase(budget.vae, shape, decode=False)
    dec = _vae_phase(budget.vae, shape, decode=True)
    dit_weights = dw.resident(place.blocks_to_swap, place.swap_io) if place.swapping else dw.total
    dit_act = dit_activation_bytes(budget.dit, shape) + dw.largest_layer * b
    vd, dd = place.vae_device, place.dit_device
    return Estimate((
        need("encode", vd, [("VAE weights", vw.total), ("DiT weights", parked_dit(vd))],
             enc + vae_transient),
        need("DiT", dd, [("DiT weights", dit_weights), ("VAE weights", parked_vae(dd))], dit_act),
        need("decode", vd, [("VAE weights", vw.total), ("DiT weights", parked_dit(vd))],
             dec + vae_transient),
    ))


def shortfalls(est: Estimate, available: Mapping[str, int]) -> list[tuple[PhaseNeed, int]]:
    """(worst phase, bytes available) for each device in ``available`` the job exceeds."""
    return [(worst, have) for device, have in available.items()
            if (worst := est.worst(device)) is not None and worst.total > have]


def fits(budget: Budget, shape: BatchShape, place: Placement, available: Mapping[str, int]) -> bool:
    return not shortfalls(estimate(budget, shape, place), available)


# == Settings that fit

def smallest_batch(temporal_overlap: int) -> int:
    """The smallest batch the option check accepts: 4n+1 above ``temporal_overlap``."""
    return temporal_overlap + 1 + (-temporal_overlap) % 4


def batch_candidates(plan_frames: int, temporal_overlap: int, lowest: int = AUTO_MIN_BATCH,
                     highest: int = AUTO_MAX_BATCH) -> list[int]:
    """4n+1 batch sizes 'auto' may pick, largest first: above ``temporal_overlap``, at most the
    clip (rounded up to 4n+1) and ``highest``, at least ``lowest`` unless the clip is shorter."""
    floor = smallest_batch(temporal_overlap)
    top = max(min(plan_frames + (1 - plan_frames) % 4, highest), floor)
    bottom = max(floor, min(lowest, top))
    return list(range(top, bottom - 1, -4))


_TILE_STEPS = ((512, 64), (256, 32), (128, 16))  # VAE tile sizes tried, with their overlaps


def failing_phases(est: Estimate, available: Mapping[str, int]) -> set:
    return {p.phase for p in est.phases if p.device in available and p.total > available[p.device]}


def _tile_change(shape: BatchShape, which: Sequence[str], size: int, overlap: int) -> tuple[BatchShape, str]:
    """The shape with VAE tiles of ``size`` pixels on the phases in ``which`` (keeping each
    phase's overlap when it is smaller than half a tile, else ``overlap``), and its text."""
    changes, enable, sizes, overlaps = {}, [], [], []
    for w in which:
        current = getattr(shape, f"{w}_tiles")
        keep = current.tile_overlap if current.tile_overlap <= size // 2 else overlap
        changes[f"{w}_tiles"] = replace(current, enabled=True, tile_size=size, tile_overlap=keep)
        if not current.enabled:
            enable.append(option_ref(f"vae_{w}_tiled", True))
        sizes.append(option_ref(f"vae_{w}_tile_size", size))
        if keep != current.tile_overlap:
            overlaps.append(option_ref(f"vae_{w}_tile_overlap", keep))
    text = " and ".join(sizes + overlaps)
    if enable:
        text = " and ".join(enable) + " with " + text
    return replace(shape, **changes), text


def _tile_options(shape: BatchShape, which: Sequence[str]) -> list[tuple[BatchShape, Optional[str]]]:
    """The shape as it is, then with tiles of each smaller step on the VAE phases in ``which``."""
    current = min((getattr(shape, f"{w}_tiles").tile_size for w in which
                   if getattr(shape, f"{w}_tiles").enabled), default=None)
    out = [(shape, None)]
    for size, overlap in _TILE_STEPS:
        if which and (current is None or size < current):
            out.append(_tile_change(shape, which, size, overlap))
    return out


def _swap_options(budget: Budget, place: Placement) -> list[tuple[Placement, Optional[str]]]:
    """The placement as it is, then BlockSwap of 1..all blocks, then also the I/O layers."""
    out = [(place, None)]
    if not place.dit_device.startswith("cuda"):
        return out
    offload = place.dit_offload or "cpu"
    suffix = "" if place.dit_offload else f" with {option_ref('dit_offload_device', offload)}"
    for swap_io in (False, True):
        for n in range(1, len(budget.dit_weights.blocks) + 1):
            if (n, swap_io) <= (place.blocks_to_swap, place.swap_io):
                continue
            io = f" and {option_ref('swap_io_components', True)}" if swap_io else ""
            out.append((replace(place, blocks_to_swap=n, swap_io=swap_io, dit_offload=offload),
                        f"{option_ref('blocks_to_swap', n)}{io}{suffix}"))
    return out


def _first_fit(budget: Budget, options: list, available: Mapping[str, int]):
    """The first (shape, placement, text) of ``options`` (monotone: later ones need less)
    that fits, by bisection; None when none does."""
    lo, hi = 0, len(options) - 1
    if hi < 0 or not fits(budget, *options[hi][:2], available):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(budget, *options[mid][:2], available):
            hi = mid
        else:
            lo = mid + 1
    return options[lo]


def _single_changes(budget: Budget, shape: BatchShape, place: Placement, failing: set,
                    min_batch: int):
    """Each kind of single change, cheapest first (the README's "Out of memory"), as a list of
    (shape, placement, text) from the least to the most it changes: smaller batches, VAE tiles,
    the VAE's tails in int8, offloading the VAE, the DiT or both (text None: never alone),
    waiting tensors, BlockSwap."""
    yield [(replace(shape, batch_size=n), place, option_ref("batch_size", n))
           for n in range(shape.batch_size - 4, min_batch - 1, -4)]
    yield [(tiled, place, text) for tiled, text in
           _tile_options(shape, [w for w in ("encode", "decode") if w in failing])[1:]]
    if shape.vae_int8_cache == "off" and failing & {"encode", "decode"}:
        yield [(replace(shape, vae_int8_cache=mode), place, option_ref("vae_int8_cache", mode))
               for mode in ("on", "host")]
    if place.one_accelerator:
        vae_off = replace(place, vae_offload=place.vae_offload or "cpu")
        if place.vae_offload is None:
            yield [(shape, vae_off, option_ref("vae_offload_device", "cpu"))]
        if place.dit_offload is None and not place.swapping:
            yield [(shape, replace(place, dit_offload="cpu"),
                    option_ref("dit_offload_device", "cpu"))]
            yield [(shape, replace(vae_off, dit_offload="cpu"), None)]
    if shape.chunk_size is not None and not place.host_only:
        yield [(replace(shape, chunk_size=None), place, option_ref("tensor_offload_device", "cpu"))]
    if "DiT" in failing:
        yield [(shape, swapped, text) for swapped, text in _swap_options(budget, place)[1:]]


def alternatives(budget: Budget, shape: BatchShape, place: Placement,
                 available: Mapping[str, int], min_batch: int = 1) -> list[str]:
    """Settings that would make the job fit: each single change enough on its own (the least of
    each kind); when none is, one combination (or none)."""
    failing = failing_phases(estimate(budget, shape, place), available)
    found = [_first_fit(budget, [o for o in options if o[2] is not None], available)
             for options in _single_changes(budget, shape, place, failing, min_batch)]
    if any(found):
        return [text for _, _, text in filter(None, found)]
    combined = _fit_combined(budget, shape, place, available, min_batch)
    return [] if combined is None else ["all of: " + _fit(shape, place, *combined).describe()]


@dataclass(frozen=True)
class Fit:
    """Settings that make a job fit (``fit`` auto): the option changes, as (name, value) in
    the order they were made, the shape and placement with them, and what they cost."""

    changes: tuple[tuple[str, object], ...]
    shape: BatchShape
    place: Placement
    costs: tuple[str, ...]

    def describe(self) -> str:
        return ", ".join(option_ref(name, value) for name, value in self.changes)


# What each kind of change costs, in the README's order of preference ("Out of memory").
_COSTS = {"batch": "smaller batches: less temporal consistency",
          "tiles": "VAE tiles: slight differences at their seams, a little slower",
          "int8": "the VAE's large causal tails kept in int8: slight differences",
          "offload": "models wait in host RAM between phases: a copy per chunk",
          "swap": "DiT blocks stream from host RAM: slower DiT"}


def _fit(shape: BatchShape, place: Placement, new_shape: BatchShape, new_place: Placement) -> Fit:
    """The :class:`Fit` (option changes and their costs) from (shape, place) to the new pair."""
    out, costs = [], []
    if new_shape.batch_size != shape.batch_size:
        out.append(("batch_size", new_shape.batch_size))
        costs.append(_COSTS["batch"])
    for w in ("encode", "decode"):
        old, new = getattr(shape, f"{w}_tiles"), getattr(new_shape, f"{w}_tiles")
        for attr, option in (("enabled", "tiled"), ("tile_size", "tile_size"),
                             ("tile_overlap", "tile_overlap")):
            if getattr(new, attr) != getattr(old, attr) and new.enabled:
                out.append((f"vae_{w}_{option}", getattr(new, attr)))
    if new_shape.encode_tiles != shape.encode_tiles or new_shape.decode_tiles != shape.decode_tiles:
        costs.append(_COSTS["tiles"])
    if new_shape.vae_int8_cache != shape.vae_int8_cache:
        out.append(("vae_int8_cache", new_shape.vae_int8_cache))
        costs.append(_COSTS["int8"])
    moved = [(kind, getattr(new_place, f"{kind}_offload")) for kind in ("vae", "dit")
             if getattr(new_place, f"{kind}_offload") != getattr(place, f"{kind}_offload")]
    out += [(f"{kind}_offload_device", where) for kind, where in moved]
    if new_shape.chunk_size != shape.chunk_size:
        out.append(("tensor_offload_device", "cpu"))
    if moved or new_shape.chunk_size != shape.chunk_size:
        costs.append(_COSTS["offload"])
    if (new_place.blocks_to_swap, new_place.swap_io) != (place.blocks_to_swap, place.swap_io):
        out.append(("blocks_to_swap", new_place.blocks_to_swap))
        if new_place.swap_io != place.swap_io:
            out.append(("swap_io_components", new_place.swap_io))
        costs.append(_COSTS["swap"])
    return Fit(tuple(out), new_shape, new_place, tuple(costs))


def fit_job(budget: Budget, shape: BatchShape, place: Placement,
            available: Mapping[str, int], min_batch: int = 1) -> Optional[Fit]:
    """The cheapest settings that make the job fit ``available`` (the first single change that
    is enough, else the combination :func:`alternatives` offers), or None."""
    failing = failing_phases(estimate(budget, shape, place), available)
    found = next(filter(None, (_first_fit(budget, options, available) for options in
                               _single_changes(budget, shape, place, failing, min_batch))), None)
    found = found[:2] if found is not None else _fit_combined(budget, shape, place, available,
                                                              min_batch)
    return None if found is None else _fit(shape, place, *found)


def _fit_combined(budget: Budget, shape: BatchShape, place: Placement,
                  available: Mapping[str, int], min_batch: int):
    """Every cheap saver at once, then the largest batch with the largest tiles and the
    fewest swapped blocks that fit; None when nothing does."""
    if place.one_accelerator:
        place = replace(place, vae_offload=place.vae_offload or "cpu")
        if not place.swapping:
            place = replace(place, dit_offload=place.dit_offload or "cpu")
    if shape.chunk_size is not None and not place.host_only:
        shape = replace(shape, chunk_size=None)
    swaps = _swap_options(budget, place)
    for size in range(shape.batch_size, min_batch - 1, -4):
        for tiled, _ in _tile_options(replace(shape, batch_size=size), ("encode", "decode")):
            swap = _first_fit(budget, [(tiled, p, text) for p, text in swaps], available)
            if swap is not None:
                return tiled, swap[1]
    return None


def check(budget: Budget, shape: BatchShape, place: Placement, available: Mapping[str, int],
          min_batch: int = 1, batch_text: Optional[str] = None) -> Estimate:
    """The estimate, or :class:`BudgetError` when a device in ``available`` is short; the
    message lists settings that would fit (or says that none do)."""
    est = estimate(budget, shape, place)
    short = shortfalls(est, available)
    if not short:
        return est
    need, have = short[0]
    message = (f"not enough memory on {need.device} for {shape.width}x{shape.height} frames at "
               f"{batch_text or option_ref('batch_size', shape.batch_size)}: the {need.phase} "
               f"phase needs about {gib(need.total)} ({need.describe()}) but {gib(have)} is "
               f"available")
    alts = alternatives(budget, shape, place, available, min_batch)
    if alts:
        message += ". Settings that would fit: " + "; or ".join(alts)
    else:
        swapped = " and every DiT block swapped" if place.dit_device.startswith("cuda") else ""
        message += (f". Nothing fits at this resolution, even with the smallest batch, VAE "
                    f"tiles of 128 pixels{swapped}: lower {option_ref('resolution')} or use a "
                    f"device with more memory")
    if need.device.startswith("cuda"):
        message += f". Setting {EXPANDABLE_SEGMENTS} in the environment also helps (less fragmentation)"
    raise BudgetError(message)


def auto_batch_size(budget: Budget, shape: BatchShape, place: Placement, available: Mapping[str, int],
                    plan_frames: int, temporal_overlap: int, strict: bool = True) -> int:
    """The largest of :func:`batch_candidates` that fits (on CUDA within :data:`AUTO_CUDA_SHARE`);
    nothing known, or nothing fits and not ``strict`` (``fit`` auto changes other settings):
    the smallest; else :class:`BudgetError` naming what would fit."""
    candidates = batch_candidates(plan_frames, temporal_overlap)
    planned = {d: int(have * AUTO_CUDA_SHARE) if d.startswith("cuda") else have
               for d, have in available.items()}
    for size in candidates if available else ():
        if fits(budget, replace(shape, batch_size=size), place, planned):
            return size
    if strict:  # only the smallest fits, above the share: still worth a try; else refused
        check(budget, replace(shape, batch_size=candidates[-1]), place, available,
              min_batch=smallest_batch(temporal_overlap),
              batch_text=f"{option_ref('batch_size', 'auto')} (even {candidates[-1]} frames)")
    return candidates[-1]


# == Host RAM checks

def exact_tiling_host_bytes(cfg: VAEConfig, shape: BatchShape,
                            stages: tuple = ("encode", "decode")) -> int:
    """Host RAM exact tiling holds in frame-wide planes (``state_device`` cpu) for ``stages``:
    about three full-resolution planes over the frames in flight, in the model dtype."""
    c0, c1 = cfg.block_out_channels[0], cfg.block_out_channels[min(1, len(cfg.block_out_channels) - 1)]

    def frames(slice_: Optional[int]) -> int:
        return shape.batch_size if not slice_ else min(shape.batch_size, 1 + slice_) + 2
    decode = (c1 + 2 * c0) * frames(shape.decode_slice) if "decode" in stages else 0
    encode = 3 * c0 * frames(shape.encode_slice) if "encode" in stages else 0
    return max(decode, encode) * shape.height * shape.width * shape.dtype_bytes


def check_exact_tiling(cfg: VAEConfig, shape: BatchShape, available: Optional[int],
                       stages: tuple = ("encode", "decode")) -> int:
    """Raise :class:`BudgetError` when exact tiling's planes exceed the host RAM; returns them."""
    need = exact_tiling_host_bytes(cfg, shape, stages)
    available = known_size(available, "the host's RAM")
    if available is None or need <= 0.9 * available:
        return need
    sliced = exact_tiling_host_bytes(cfg, replace(shape, encode_slice=4, decode_slice=4), stages)
    fix = (f"{option_ref('vae_encode_temporal_slice', 4)} and "
           f"{option_ref('vae_decode_temporal_slice', 4)} (same result, "
           f"about {gib(sliced)}); or " if sliced <= 0.9 * available
           and (shape.decode_slice, shape.encode_slice) != (4, 4) else "")
    raise BudgetError(f"{option_ref('vae_tiling_exact')} keeps whole-frame activations in host "
                      f"RAM: about {gib(need)} for {shape.width}x{shape.height} frames at "
                      f"{option_ref('batch_size', shape.batch_size)}, but {gib(available)} is "
                      f"available. Settings that would fit: {fix}"
                      f"{option_ref('vae_tiling_exact', False)} (independent tiles, little memory)")


HOST_COPY_SHARE = 0.9  # of the host RAM available, what persistent (pinned) weight copies may take


def check_host_copy(nbytes: int, available: Optional[int], setting: str):
    """Raise :class:`BudgetError` when a model's persistent host copy (``nbytes``) would not fit
    the host RAM ``available`` (None: no check): pinned on CUDA machines, its pages can never be
    swapped out, so over-committing them stalls the machine instead of failing cleanly."""
    available = known_size(available, "the host's RAM")
    if available is None or nbytes <= HOST_COPY_SHARE * available:
        return
    raise BudgetError(f"{option_ref(setting, 'cpu')} keeps a copy of the model's weights in "
                      f"host RAM: {gib(nbytes)} (pinned, never swapped out), but "
                      f"{gib(available)} is available. Set {option_ref(setting, 'none')} (the "
                      f"model stays on its device), use a smaller (quantised) weight file, or "
                      f"free host RAM")


# == What is available here (the impure part)

def host_available() -> Optional[int]:
    """Bytes of RAM available to new allocations (MemAvailable), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_rss() -> Optional[int]:
    """Resident set size of this process now, or None when unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def known_size(reported, source: str) -> Optional[int]:
    """A report of free memory as bytes, or None (unknown) when it is no size: NaN, infinite
    or negative (a broken driver or host report), said in the log; never taken as plenty."""
    if reported is None or (isinstance(reported, (int, float)) and math.isfinite(reported)
                            and reported >= 0):
        return None if reported is None else int(reported)
    log.warning("%s reported %r bytes free, which is no size: treated as unknown (the memory "
                "budget is not checked against it; max_vram still caps the job)", source, reported)
    return None


def device_available(device: torch.device, own_bytes: int = 0) -> Optional[int]:
    """Bytes a job can use on ``device``: free plus cached-but-unallocated memory (off CUDA:
    host RAM), plus ``own_bytes`` (our models' tensors there, counted in the estimate)."""
    device = torch.device(device)
    if device.type == "cuda":
        free = known_size(torch.cuda.mem_get_info(device)[0], str(device))
        # Cached blocks split by smaller tensors cannot take one large tensor: not free.
        stranded = torch.cuda.memory_stats(device).get("inactive_split_bytes.all.current", 0)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - stranded
        return None if free is None else free + cached + own_bytes
    ram = known_size(host_available(), "the host's RAM")
    return None if ram is None else ram + own_bytes
