"""Run the causal video VAE in bounded memory: spatial tiles and causal temporal slices.

Causal temporal slices are exact (a ``CausalCache`` carries each conv's last frames). Exact spatial
tiles (default) run the network layer by layer over frame-wide planes on ``state_device``, tile by
tile, with whole-frame GroupNorm statistics (untiled up to rounding); fast tiles (``exact=False``)
are independent and cross-faded (approximate). Design, bounds and costs: docs/memory.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..options import OptionError
from ..errors import InputError, UsageError
from ..models.pointwise import silu
from ..models.vae import Decoder, Encoder, VideoAutoencoder
from ..models.vae_blocks import (ATTENTION_SCORE_BUDGET, CausalCache, CausalConv3d, FrameAttention,
                                 FrameGroupNorm, ResnetBlock3D, Upsample3D, conv3d, depth_to_space,
                                 group_stats_from_channels)
from .placement import tail_parking

TILE_MULTIPLE = 8  # pixels per latent along H and W in every SeedVR2 VAE (spatial factor)

# Called before every tile and slice, outside the VAE's (possibly compiled) forwards: the
# pipeline's stop check, so a Cancel takes effect within a tile.
Between = Optional[Callable[[], None]]


def _nothing() -> None:
    pass


def _nearest_multiples(value: int, multiple: int, allow_zero: bool = False) -> str:
    lower = value - value % multiple
    return f"{lower} or {lower + multiple}" if lower > 0 or allow_zero else f"{multiple}"


@dataclass(frozen=True)
class TileSettings:
    """Spatial tiling of VAE encode or decode (the ``vae_*_tile*`` options) in video pixels,
    multiples of 8 (the latent grid). ``exact`` (default): frame-wide planes on ``state_device``
    (``None``: the VAE's device), no overlap; else independent cross-faded tiles, whose overlap
    should cover the ~48-pixel border error (docs/memory.md, "VAE tiling")."""

    enabled: bool = False
    tile_size: int = 512
    tile_overlap: int = 64
    exact: bool = True
    state_device: Optional[str] = "cpu"

    def __post_init__(self) -> None:
        for name in ("tile_size", "tile_overlap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionError(f"{name} must be an int number of pixels, got {value!r}")
        m = TILE_MULTIPLE
        if self.tile_size <= 0 or self.tile_size % m:
            raise OptionError(f"tile_size = {self.tile_size}: must be a positive multiple of {m} "
                              f"pixels (the VAE's spatial factor); use "
                              f"{_nearest_multiples(self.tile_size, m)}")
        if self.tile_overlap < 0 or self.tile_overlap % m:
            fix = _nearest_multiples(self.tile_overlap, m, True) if self.tile_overlap > 0 else "0"
            raise OptionError(f"tile_overlap = {self.tile_overlap}: must be a multiple of {m} "
                              f"pixels >= 0 (the VAE's spatial factor); use {fix}")
        if self.tile_overlap >= self.tile_size:
            raise OptionError(f"tile_overlap = {self.tile_overlap} must be smaller than "
                              f"tile_size = {self.tile_size}; lower the overlap (e.g. "
                              f"{max(self.tile_size // 8 // m * m, 0)}) or raise the tile size")
        if not isinstance(self.exact, bool):
            raise OptionError(f"exact must be True or False, got {self.exact!r}")
        if self.state_device is not None:
            try:
                torch.device(self.state_device)
            except (RuntimeError, TypeError):
                raise OptionError(f"state_device = {self.state_device!r}: expected a device "
                                  f"such as 'cpu' or 'cuda:0', or None for the VAE's device"
                                  ) from None


def settings_from_options(opts, stage: str) -> Tuple[TileSettings, Optional[int]]:
    """``(TileSettings, temporal_chunk)`` of ``stage`` ("encode" or "decode") from resolved
    options (``vae_<stage>_tiled``, ``_tile_size``, ``_tile_overlap``, ``_temporal_slice``)."""
    if stage not in ("encode", "decode"):
        raise InputError(f"stage must be 'encode' or 'decode', got {stage!r}")
    get = lambda name: getattr(opts, f"vae_{stage}_{name}")  # noqa: E731
    tiles = TileSettings(get("tiled"), get("tile_size"), get("tile_overlap"),
                         exact=opts.vae_tiling_exact)
    return tiles, (get("temporal_slice") or None)


# -- argument checks --------------------------------------------------------------------------

def _check_settings(vae: VideoAutoencoder, tiles: TileSettings,
                    temporal_chunk: Optional[int]) -> None:
    if not isinstance(tiles, TileSettings):
        raise UsageError(f"tiles must be a TileSettings, got {type(tiles).__name__}")
    s = vae.spatial_factor
    if tiles.tile_size % s or tiles.tile_overlap % s:
        raise OptionError(f"tile_size = {tiles.tile_size} and tile_overlap = {tiles.tile_overlap} "
                          f"must be multiples of this VAE's spatial factor {s}")
    if temporal_chunk is not None:
        f = vae.temporal_factor
        if isinstance(temporal_chunk, bool) or not isinstance(temporal_chunk, int) \
                or temporal_chunk <= 0 or temporal_chunk % f:
            raise OptionError(f"temporal_chunk = {temporal_chunk!r}: must be a positive multiple "
                              f"of {f} video frames (the VAE's temporal factor; chunks are "
                              f"1 + {f}k frames, then {f}k), or None for no temporal slicing")


def _chunks(count: int, first: int, rest: int) -> List[Tuple[int, int]]:
    """``[0, count)`` cut into ``[0, first)``, then pieces of ``rest``."""
    bounds = [(0, min(first, count))]
    while bounds[-1][1] < count:
        start = bounds[-1][1]
        bounds.append((start, min(start + rest, count)))
    return bounds


def tile_layout(length: int, tile: int, overlap: int) -> Tuple[List[int], int]:
    """``(starts, size)``: the fewest tiles of at most ``tile`` covering ``[0, length)``, with
    neighbours sharing at least ``overlap``, of the smallest equal ``size``, spread evenly from
    0 to ``length - size`` (none overhangs the frame or repeats more than the overlap needs)."""
    if length <= tile:
        return [0], length
    count = -(-(length - overlap) // (tile - overlap))
    size = -(-(length + (count - 1) * overlap) // count)
    return [(length - size) * i // (count - 1) for i in range(count)], size


# == exact mode: frame-wide planes, tile-wise layers ==========================================

class _ChannelStats:
    """Per (sample, channel, frame) mean and sum of squared deviations of a plane, folded in
    tile by tile (Chan's pairwise update, float32 or float64), with the count per frame."""

    def __init__(self, B: int, C: int, T: int, dtype: torch.dtype, device: torch.device) -> None:
        self.count = torch.zeros(B, 1, T, dtype=dtype, device=device)
        self.mean = torch.zeros(B, C, T, dtype=dtype, device=device)
        self.m2 = torch.zeros(B, C, T, dtype=dtype, device=device)

    def add(self, x: Tensor, b0: int = 0, t0: int = 0) -> None:
        """Fold in ``x`` ``(b, C, t, h, w)``: samples ``b0 ..``, frames ``t0 ..``."""
        b, _, t = x.shape[:3]
        n_b = float(x.shape[3] * x.shape[4])
        var_b, mean_b = torch.var_mean(x.flatten(3).to(self.mean.dtype), dim=-1, correction=0)
        where = (slice(b0, b0 + b), slice(None), slice(t0, t0 + t))
        n_a = self.count[where]
        n = n_a + n_b
        mean_a = self.mean[where]
        delta = mean_b - mean_a
        mean_a.add_(delta * (n_b / n))
        self.m2[where].add_(var_b * n_b + delta.square() * (n_a * n_b / n))
        n_a.copy_(n)

    def group(self, groups: int) -> Tuple[Tensor, Tensor]:
        """Group mean and variance ``(B, G, 1, T)``, as ``FrameGroupNorm`` derives them."""
        return group_stats_from_channels(self.mean, self.m2 / self.count, groups)


class _FixedStats(CausalCache):
    """Hands a norm precomputed whole-frame statistics (frames ``t0 ..``, samples ``b0 ..``)."""

    def __init__(self, stats: _ChannelStats, b0: int = 0, b1: Optional[int] = None,
                 t0: int = 0, t1: Optional[int] = None) -> None:
        super().__init__(temporal=False)
        self.stats, self.where = stats, (slice(b0, b1), slice(None), slice(None), slice(t0, t1))

    def group_norm_stats(self, norm: FrameGroupNorm, x: Tensor) -> Tuple[Tensor, Tensor]:
        mean, var = self.stats.group(norm.num_groups)
        return mean[self.where].to(x.dtype), var[self.where].to(x.dtype)


@dataclass
class _Plane:
    """A frame-wide activation (state device; inputs: any tensor), its statistics if normed."""

    data: Tensor
    stats: Optional[_ChannelStats] = None


def _grid(size: int, edge: int) -> List[Tuple[int, int]]:
    return [(a, min(a + edge, size)) for a in range(0, size, edge)]


def _clip(lo: int, hi: int, size: int) -> Tuple[int, int, int, int]:
    """``[lo, hi)`` clipped to ``[0, size)``, and the zeros missing before / after it."""
    a, b = max(lo, 0), min(hi, size)
    return a, b, a - lo, hi - b


class _ExactRun:
    """One exact tiled encode or decode: the coder's ``layers()`` in its forward's maths (the
    tiled-vs-untiled tests check it), each layer tile by tile."""

    def __init__(self, vae: VideoAutoencoder, tiles: TileSettings, latent_size: Tuple[int, int],
                 device: torch.device, between: Between = None) -> None:
        self.dtype, self.device = vae.dtype, device
        self.between = between or _nothing
        self.state = device if tiles.state_device is None else torch.device(tiles.state_device)
        self.tile_latents = tiles.tile_size // vae.spatial_factor
        self.latent_h, self.latent_w = latent_size
        self.stats_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.tails: Dict[nn.Module, Tensor] = {}  # frame-wide carried frames per causal conv
        self.first_chunk, self.keep_tails = True, False

    def _edges(self, H: int, W: int) -> Tuple[int, int]:
        """Tile edge in samples for a plane of ``H x W`` (``tile_size`` pixels of the video)."""
        return (self.tile_latents * max(H // self.latent_h, 1),
                self.tile_latents * max(W // self.latent_w, 1))

    def _new_plane(self, shape, stats: bool = True) -> _Plane:
        data = torch.empty(shape, dtype=self.dtype, device=self.state)
        B, C, T = shape[:3]
        return _Plane(data, _ChannelStats(B, C, T, self.stats_dtype, self.device)
                      if stats else None)

    def _fetch(self, x: Tensor) -> Tensor:
        return x.to(device=self.device, dtype=self.dtype)

    def _activate(self, src: _Plane, norm: Optional[FrameGroupNorm]) -> Callable:
        """A producer of ``silu(norm(src))`` (or ``src``) over a clipped region."""
        def produce(r0: int, r1: int, c0: int, c1: int) -> Tensor:
            x = self._fetch(src.data[..., r0:r1, c0:c1])
            if norm is None:
                return x
            return silu(norm(x, cache=_FixedStats(src.stats)), inplace=True)
        return produce

    def _conv(self, conv: CausalConv3d, shape, produce: Callable, dst: Optional[_Plane] = None,
              residual: Optional[Callable] = None, stats: bool = True) -> _Plane:
        """``conv`` over an input of ``shape`` whose regions ``produce`` returns, by output tile,
        into ``dst`` (None: a new plane), plus ``residual(o0, o1, q0, q1)`` when given."""
        B, _, T, H, W = shape
        kt, kh, kw = conv.kernel_size
        st, sh, sw = conv.stride
        if conv.spatial_pad is None:
            top = bottom = conv.conv_padding[1]
            left = right = conv.conv_padding[2]
        else:
            left, right, top, bottom = conv.spatial_pad
        Ho, Wo = (H + top + bottom - kh) // sh + 1, (W + left + right - kw) // sw + 1
        head = self.tails.get(conv)
        n_head = head.shape[2] if head is not None else conv.head_frames
        To = (n_head + T - kt) // st + 1
        if dst is None:
            dst = self._new_plane((B, conv.out_channels, To, Ho, Wo), stats)
        tail = None
        if self.keep_tails and conv.tail_frames:
            tail = torch.empty((B, conv.in_channels, conv.tail_frames, H, W), dtype=self.dtype,
                               device=self.state)
        eh, ew = self._edges(Ho, Wo)
        for o0, o1 in _grid(Ho, eh):
            r0, r1, pad_t, pad_b = _clip(o0 * sh - top, (o1 - 1) * sh + kh - top, H)
            for q0, q1 in _grid(Wo, ew):
                self.between()
                c0, c1, pad_l, pad_r = _clip(q0 * sw - left, (q1 - 1) * sw + kw - left, W)
                x = produce(r0, r1, c0, c1)
                if head is not None:
                    x = torch.cat([self._fetch(head[..., r0:r1, c0:c1]), x], dim=2)
                elif conv.head_frames:
                    x = torch.cat([x[:, :, :1].expand(-1, -1, conv.head_frames, -1, -1), x], 2)
                if tail is not None:  # this tile's share of the frames the next chunk needs
                    a0, a1 = o0 * sh, min(o1 * sh, H)
                    b0, b1 = q0 * sw, min(q1 * sw, W)
                    tail[..., a0:a1, b0:b1].copy_(
                        x[:, :, x.shape[2] - conv.tail_frames:, a0 - r0:a1 - r0, b0 - c0:b1 - c0])
                if pad_t or pad_b or pad_l or pad_r:
                    x = F.pad(x, (pad_l, pad_r, pad_t, pad_b))
                y = conv3d(x, conv.weight, conv.bias, conv.stride, 0, conv.paths)
                del x
                if residual is not None:
                    y.add_(residual(o0, o1, q0, q1))
                if dst.stats is not None:
                    dst.stats.add(y)
                dst.data[..., o0:o1, q0:q1].copy_(y)
                del y
        if tail is not None:
            self.tails[conv] = tail
        else:
            self.tails.pop(conv, None)
        return dst

    def _resnet(self, block: ResnetBlock3D, x: _Plane) -> _Plane:
        h = self._conv(block.conv1, x.data.shape, self._activate(x, block.norm1))
        shortcut = block.conv_shortcut

        def residual(o0: int, o1: int, q0: int, q1: int) -> Tensor:
            r = self._fetch(x.data[..., o0:o1, q0:q1])
            return r if shortcut is None else conv3d(r, shortcut.weight, shortcut.bias, 1, 0,
                                                     shortcut.paths)

        # Without a width change the output overwrites x: each tile reads x only where it
        # writes, after reading it, and conv1 (the only other reader) is done.
        dst = None
        if shortcut is None and x.data.device == self.state:
            dst = _Plane(x.data, _ChannelStats(*x.data.shape[:3], self.stats_dtype, self.device))
        out = self._conv(block.conv2, h.data.shape, self._activate(h, block.norm2), dst=dst,
                         residual=residual)
        del h
        return out

    def _attention(self, attn: FrameAttention, x: _Plane) -> _Plane:
        B, C, T, H, W = x.data.shape
        N = H * W
        out = self._new_plane(x.data.shape)
        rows = max(ATTENTION_SCORE_BUDGET // N, 1)
        for b in range(B):
            for t in range(T):
                self.between()
                xf = self._fetch(x.data[b:b + 1, :, t:t + 1])  # the whole frame, latent res
                fixed = _FixedStats(x.stats, b, b + 1, t, t + 1)
                tokens = attn.group_norm(xf, cache=fixed).permute(0, 2, 3, 4, 1).reshape(1, N, C)
                k = attn.to_k(tokens).unsqueeze(1)
                v = attn.to_v(tokens).unsqueeze(1)
                o = torch.empty_like(tokens)
                for r0 in range(0, N, rows):
                    q = attn.to_q(tokens[:, r0:r0 + rows]).unsqueeze(1)
                    o[:, r0:r0 + rows] = F.scaled_dot_product_attention(q, k, v).squeeze(1)
                del tokens, k, v
                y = xf + attn.to_out[0](o).view(1, 1, H, W, C).permute(0, 4, 1, 2, 3)
                out.stats.add(y, b, t)
                out.data[b:b + 1, :, t:t + 1].copy_(y)
        return out

    def _upsample(self, up: Upsample3D, x: _Plane) -> _Plane:
        B, C, T, H, W = x.data.shape
        r, z = up.space_ratio, up.time_ratio
        drop = z > 1 and self.first_chunk  # the clip's first frame has no duplicate

        def produce(r0: int, r1: int, c0: int, c1: int) -> Tensor:
            # Depth-to-space of the source samples covering [r0, r1) x [c0, c1).
            a0, a1, b0, b1 = r0 // r, -(-r1 // r), c0 // r, -(-c1 // r)
            y = conv3d(self._fetch(x.data[..., a0:a1, b0:b1]), up.upscale_conv.weight,
                       up.upscale_conv.bias, paths=up.conv.paths)
            rows = y.new_empty(B, C, T * z - drop, (a1 - a0) * r, (b1 - b0) * r)
            depth_to_space(y, rows, (C, r, z), drop)
            return rows[..., r0 - a0 * r:r1 - a0 * r, c0 - b0 * r:c1 - b0 * r]

        return self._conv(up.conv, (B, C, T * z - drop, H * r, W * r), produce)

    def _norm_out(self, norm: FrameGroupNorm, conv: CausalConv3d, x: _Plane, dst: Tensor) -> None:
        self._conv(conv, x.data.shape, self._activate(x, norm), dst=_Plane(dst))

    def through(self, coder: Union[Encoder, Decoder], x: Tensor, out: Tensor) -> None:
        """``out`` (any device) = ``coder(x)`` for one chunk of frames: the encoder's moments
        or the decoder's video, through the layers ``coder.layers()`` lists."""
        conv_in, *layers = coder.layers()
        h = self._conv(conv_in, x.shape, self._activate(_Plane(x), None))
        for layer in layers:
            if isinstance(layer, ResnetBlock3D):
                h = self._resnet(layer, h)
            elif isinstance(layer, FrameAttention):
                h = self._attention(layer, h)
            elif isinstance(layer, Upsample3D):
                h = self._upsample(layer, h)
            else:  # Downsample3D
                h = self._conv(layer.conv, h.data.shape, self._activate(h, None))
        self._norm_out(coder.conv_norm_out, coder.conv_out, h, out)
        self.first_chunk = False


def _needs_tiles(tiles: TileSettings, h: int, w: int, s: int) -> bool:
    size = tiles.tile_size // s
    return tiles.enabled and (h > size or w > size)


def _first_out_frame(frame: int, f: int, encoding: bool) -> int:
    """The first output frame of input frame ``frame`` (the start of a chunk from it): video
    frame 0 is latent frame 0, latent frame k > 0 is video frames 4k-3 .. 4k."""
    return 0 if frame == 0 else (frame - 1) // f + 1 if encoding else f * (frame - 1) + 1


def _exact(vae: VideoAutoencoder, x: Tensor, tiles: TileSettings,
           chunks: List[Tuple[int, int]], between: Between, encoding: bool):
    """Encode or decode ``x`` in exact tiles, its chunks in order through one :class:`_ExactRun`."""
    B, _, T, H, W = x.shape
    s, f = vae.spatial_factor, vae.temporal_factor
    if encoding:
        out_shape, latent = (B, 2 * vae.latent_channels, (T - 1) // f + 1, H // s, W // s), \
            (H // s, W // s)
    else:
        out_shape, latent = (B, vae.config.out_channels, f * (T - 1) + 1, H * s, W * s), (H, W)
    out = torch.empty(out_shape, dtype=vae.dtype, device=x.device)
    run = _ExactRun(vae, tiles, latent, x.device, between)
    for i, (a0, a1) in enumerate(chunks):
        run.keep_tails = i + 1 < len(chunks)
        piece = x[:, :, a0:a1]
        if not encoding and vae.post_quant_conv is not None:  # 1x1x1: pointwise
            piece = vae.post_quant_conv(piece.to(vae.dtype))
        run.through(vae.encoder if encoding else vae.decoder, piece,
                    out[:, :, _first_out_frame(a0, f, encoding):_first_out_frame(a1, f, encoding)])
    return vae.posterior(out) if encoding else out


# == fast mode: independent overlapping tiles, cross-faded ====================================

@dataclass(frozen=True)
class _Span:
    """One tile along one axis: latents ``[start, stop)``, its outputs' blend weight (None: 1)."""

    start: int
    stop: int
    weight: Optional[Tensor]


def _ramp(n: int) -> Tensor:
    """Raised-cosine fade-in over ``n`` samples, strictly inside (0, 1); ``_ramp(n)`` plus its
    mirror image is exactly 1, so two tiles fading over the same ``n`` samples sum to 1."""
    x = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    return torch.sin(0.5 * math.pi * x).square()


def _axis_spans(length: int, tile: int, overlap: int, scale: int,
                dtype: torch.dtype, device: torch.device) -> List[_Span]:
    """Tiles along an axis of ``length`` latents, weights in output units (``scale`` per latent)."""
    starts, size = tile_layout(length, tile, overlap)
    if len(starts) == 1:
        return [_Span(0, length, None)]
    n = size * scale
    raw = []
    for k, start in enumerate(starts):
        w = torch.ones(n, dtype=torch.float64)
        # Fade over the *actual* overlap with each neighbour (at least ``overlap``, more where the
        # even spread rounds): both fade over the same samples, a smooth partition of unity.
        if k > 0:
            fade_in = (starts[k - 1] + size - start) * scale
            if fade_in > 0:
                w[:fade_in] *= _ramp(fade_in)
        if k < len(starts) - 1:
            fade_out = (start + size - starts[k + 1]) * scale
            if fade_out > 0:
                w[n - fade_out:] *= _ramp(fade_out).flip(0)
        raw.append(w)
    # Normalise so the weights sum to exactly 1 everywhere (needed where more than two tiles
    # overlap, i.e. overlap > tile / 2; a no-op up to rounding otherwise).
    total = torch.zeros(length * scale, dtype=torch.float64)
    for start, w in zip(starts, raw):
        total[start * scale:start * scale + n] += w
    return [_Span(start, start + size,
                  (w / total[start * scale:start * scale + n]).to(device=device, dtype=dtype))
            for start, w in zip(starts, raw)]


def _tile_weight(row: _Span, col: _Span) -> Optional[Tensor]:
    """The 2-D ``(h, w)`` blend weight of one tile (broadcast over batch, channel, time)."""
    if row.weight is None and col.weight is None:
        return None
    if row.weight is None:
        return col.weight.unsqueeze(0)
    if col.weight is None:
        return row.weight.unsqueeze(1)
    return row.weight.unsqueeze(1) * col.weight.unsqueeze(0)


def _blend_into(out: Tensor, region: Tuple[slice, ...], piece: Tensor,
                weight: Optional[Tensor]) -> None:
    """``out[region] += weight * piece``, or a plain copy for the only tile."""
    view = out[region]
    if weight is None:
        view.copy_(piece)
    elif view.dtype == weight.dtype:
        view.addcmul_(piece, weight)
    else:  # reduced precision: add in float32 and round once
        view.copy_(view.float().addcmul_(piece.float(), weight))


def _layout(vae: VideoAutoencoder, tiles: TileSettings, h: int, w: int, scale: int,
            device: torch.device) -> Tuple[List[_Span], List[_Span]]:
    if not tiles.enabled:
        return [_Span(0, h, None)], [_Span(0, w, None)]
    s = vae.spatial_factor
    # Blend weights in the accumulation precision: float32 unless the VAE runs in fp32/fp64.
    dtype = vae.dtype if vae.dtype in (torch.float32, torch.float64) else torch.float32
    size, overlap = tiles.tile_size // s, tiles.tile_overlap // s
    return (_axis_spans(h, size, overlap, scale, dtype, device),
            _axis_spans(w, size, overlap, scale, dtype, device))


def _fast(vae: VideoAutoencoder, x: Tensor, tiles: TileSettings,
          chunks: List[Tuple[int, int]], between: Between, encoding: bool):
    """Encode or decode ``x`` in independent cross-faded tiles, a tile's chunks in one cache."""
    B, _, T, H, W = x.shape
    s, f, dtype = vae.spatial_factor, vae.temporal_factor, vae.dtype
    # Tiles are cut on the latent grid: samples per latent of the input and of the output.
    x_per, out_per = (s, 1) if encoding else (1, s)
    h, w = H // x_per, W // x_per
    rows, cols = _layout(vae, tiles, h, w, out_per, x.device)
    if encoding:
        shape = (B, vae.latent_channels, (T - 1) // f + 1, h, w)
    else:
        shape = (B, vae.config.out_channels, f * (T - 1) + 1, h * s, w * s)
    outs = [torch.zeros(shape, dtype=dtype, device=x.device) for _ in range(1 + encoding)]
    for row in rows:
        for col in cols:
            weight = _tile_weight(row, col)
            cache = vae.new_cache(tail_parking(x.device)) if len(chunks) > 1 else None
            for a0, a1 in chunks:
                between()
                # The slice is a strided view; .contiguous() copies just this piece.
                piece = x[:, :, a0:a1, row.start * x_per:row.stop * x_per,
                          col.start * x_per:col.stop * x_per].to(dtype).contiguous()
                results = _fast_piece(vae, piece, cache, encoding)
                del piece
                o0 = _first_out_frame(a0, f, encoding)
                region = (slice(None), slice(None), slice(o0, o0 + results[0].shape[2]),
                          slice(row.start * out_per, row.stop * out_per),
                          slice(col.start * out_per, col.stop * out_per))
                for out, result in zip(outs, results):
                    _blend_into(out, region, result, weight)
                del results
    return tuple(outs) if encoding else outs[0]


def _fast_piece(vae: VideoAutoencoder, piece: Tensor, cache: Optional[CausalCache],
                encoding: bool) -> Tuple[Tensor, ...]:
    """One tile's chunk through the encoder (``(mean, logvar)``) or the decoder."""
    if encoding:
        return vae.posterior(vae.encoder(piece, cache))
    if vae.post_quant_conv is not None:  # 1x1x1: no temporal state
        piece = vae.post_quant_conv(piece)
    return (vae.decoder(piece, cache),)


# -- encode / decode --------------------------------------------------------------------------

def _in_pieces(vae: VideoAutoencoder, x: Tensor, tiles: TileSettings,
               temporal_chunk: Optional[int], between: Between, encoding: bool):
    """Encode or decode ``x`` in spatial tiles and/or causal temporal chunks (else plainly)."""
    _check_settings(vae, tiles, temporal_chunk)
    plain = vae.encode_posterior if encoding else vae.decode
    with vae.conv_settings():
        if not tiles.enabled and temporal_chunk is None:
            return plain(x)
        (vae.check_video if encoding else vae.check_latent)(x)
        T, H, W = x.shape[2:]
        # temporal_chunk counts video frames and tile sizes pixels: scale both to x's units.
        per_frame, s = (1, vae.spatial_factor) if encoding else (vae.temporal_factor, 1)
        chunk = temporal_chunk // per_frame if temporal_chunk is not None else T
        chunks = _chunks(T, 1 + chunk, chunk)
        tiled = _needs_tiles(tiles, H // s, W // s, vae.spatial_factor)
        if not tiled and len(chunks) == 1:
            return plain(x)
        if tiled and tiles.exact:
            return _exact(vae, x, tiles, chunks, between or _nothing, encoding)
        return _fast(vae, x, tiles if tiled else TileSettings(), chunks, between or _nothing,
                     encoding)


def encode_posterior(vae: VideoAutoencoder, video: Tensor, tiles: TileSettings,
                     temporal_chunk: Optional[int] = None,
                     between: Between = None) -> Tuple[Tensor, Tensor]:
    """``vae.encode_posterior(video)`` in spatial tiles (``tiles``, in pixels) and/or causal
    temporal chunks of ``1 + c, c, ...`` frames (``temporal_chunk`` = ``c``, a multiple of 4);
    ``between()`` is called before every tile and slice (exact mode: every layer's tile)."""
    return _in_pieces(vae, video, tiles, temporal_chunk, between, encoding=True)


def encode(vae: VideoAutoencoder, video: Tensor, tiles: TileSettings,
           temporal_chunk: Optional[int] = None, between: Between = None) -> Tensor:
    """The posterior mean from :func:`encode_posterior` (cf. ``vae.encode``)."""
    return encode_posterior(vae, video, tiles, temporal_chunk, between)[0]


def decode(vae: VideoAutoencoder, latent: Tensor, tiles: TileSettings,
           temporal_chunk: Optional[int] = None, between: Between = None) -> Tensor:
    """``vae.decode(latent)`` in spatial tiles (``tiles``, in pixels) and/or causal temporal
    chunks of ``1 + c/4, c/4, ...`` latent frames (``temporal_chunk`` = ``c``), as above."""
    return _in_pieces(vae, latent, tiles, temporal_chunk, between, encoding=False)
