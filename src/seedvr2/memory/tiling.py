"""Run the causal video VAE in bounded memory: spatial tiles and causal temporal slices.

The VAE's activations scale with ``T x H x W`` (the decoder's last stage holds several
128-channel float maps of the full output), so a 4K clip does not fit on most GPUs in one
pass. Two independent ways of cutting the work into pieces are offered here; each piece is
run through the unmodified ``VideoAutoencoder`` modules, results go into
one preallocated output (no list of pieces is kept), and peak memory is the output plus the
activations of one piece (plus, when slicing time, the few cached frames of that tile).

Causal temporal slicing (exact)
    Every layer of the VAE is causal in time: convolutions see the current and earlier frames
    only (their temporal padding repeats the first frame), and GroupNorm and the mid-block
    attention act on each frame on its own. So a clip can be run in consecutive chunks if each
    causal convolution receives, in front of a chunk, the last frames of its input from the
    previous chunk instead of the replicated first frame; a ``CausalCache`` (``vae_blocks``)
    carries exactly those frames (and the up-samplers' "first chunk" flag). The result is the
    single-pass result up to float re-association (measured <= 8e-6 on the tiny VAE, often
    bit-identical), as in the official pipeline's ``split_size`` slicing.
    ``temporal_chunk = c`` (a multiple of the temporal factor 4, in *video* frames) means:
    encode chunks of ``1 + c, c, c, ...`` frames (the strided convs need ``4k + 1`` frames
    first, then multiples of 4), decode chunks of ``1 + c/4, c/4, ...`` latent frames, i.e.
    the same ``1 + c, c, ...`` output frames. The official pipeline uses ``c = 4``.

Spatial tiling with feathered blending (approximate)
    Space cannot be sliced exactly: a tile is zero padded at its borders where the whole frame
    had neighbouring content (this reaches ~6 latents = 48 pixels into the tile, measured on
    the tiny VAE, which has the real VAE's layer structure), and GroupNorm statistics and the
    mid-block attention cover the tile instead of the whole frame (a global effect; on the
    tiny VAE the GroupNorm statistics dominate it, the attention hardly matters). Neighbouring
    tiles therefore disagree; placed side by side they would show seams. Tiles therefore
    overlap and are cross-faded: in an overlap each tile's weight rises from ~0 at its border
    to 1 (raised cosine, ``sin^2``) while its neighbour's falls, so the output is a smooth
    partition-of-unity blend that down-weights the border regions where a tile is least
    reliable. Feathering removes seams; it cannot remove the tile-wide offset that different
    normalisation statistics cause, which is why larger tiles are closer to the untiled
    result. Weights are separable (row weight x column weight) and normalised per axis, so
    they sum to 1 wherever tiles overlap, also where the last tile was shifted back inside the
    image and overlaps its neighbour by more than ``tile_overlap``.

    Tiles are laid out on the latent grid (``tile_size / 8`` latents with ``tile_overlap / 8``
    overlap; the encoder reads ``tile_size`` pixels, the decoder writes them), so a tile's
    latents and pixels are aligned with the whole frame's at every down/up-sampling level.
    Encoding blends the tiles' posterior moments in latent space (feathered over
    ``tile_overlap / 8`` latents), decoding blends decoded pixels (over ``tile_overlap``
    pixels). How far a tiled result is from the untiled one depends on the weights and the
    content; ``tests/test_tiling.py`` measures and bounds it for the tiny conformance VAE.

Both can be combined (each tile is then sliced in time with a cache of its own). With tiling
disabled and no temporal chunk, :func:`encode_posterior` and :func:`decode` *are* the plain
``vae.encode_posterior`` / ``vae.decode`` calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..models.vae import LOGVAR_MAX, LOGVAR_MIN, VideoAutoencoder
from ..models.vae_blocks import CausalCache

# Pixels per latent along H and W in every SeedVR2 VAE (spatial_downsample_factor).
TILE_MULTIPLE = 8


def _nearest_multiples(value: int, multiple: int, allow_zero: bool = False) -> str:
    lower = value - value % multiple
    return f"{lower} or {lower + multiple}" if lower > 0 or allow_zero else f"{multiple}"


@dataclass(frozen=True)
class TileSettings:
    """Spatial tiling of VAE encode or decode, sizes in pixels (of the video side).

    ``tile_size`` and ``tile_overlap`` must be multiples of 8, the VAE's spatial factor: tiles
    are cut on the latent grid (``tile_size / 8`` latents, ``tile_overlap / 8`` overlap), and
    only a tile that starts and ends on a latent boundary has latents aligned with the whole
    frame's (a tile shifted by a fraction of a latent would be sampled at a different phase by
    the strided down-samplers and could not be blended with its neighbours). Nothing coarser is
    needed: every tile edge is a multiple of 8 pixels, so all three stride-2 stages inside the
    tile see even sizes. This matches the ``vae_*_tile_size`` / ``vae_*_tile_overlap`` options.
    ``tile_overlap`` must be smaller than ``tile_size`` (tiles must advance); 0 means tiles
    abut without blending (seams; not recommended). The overlap should cover the reach of
    the border error, ~48 pixels, as the default 64 does; the price is about
    ``(tile / (tile - overlap))^2`` times the untiled work on large frames.
    """

    enabled: bool = False
    tile_size: int = 512
    tile_overlap: int = 64

    def __post_init__(self) -> None:
        for name in ("tile_size", "tile_overlap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int number of pixels, got {value!r}")
        m = TILE_MULTIPLE
        if self.tile_size <= 0 or self.tile_size % m:
            raise ValueError(f"tile_size = {self.tile_size}: must be a positive multiple of {m} "
                             f"pixels (the VAE's spatial factor); use "
                             f"{_nearest_multiples(self.tile_size, m)}")
        if self.tile_overlap < 0 or self.tile_overlap % m:
            fix = _nearest_multiples(self.tile_overlap, m, True) if self.tile_overlap > 0 else "0"
            raise ValueError(f"tile_overlap = {self.tile_overlap}: must be a multiple of {m} "
                             f"pixels >= 0 (the VAE's spatial factor); use {fix}")
        if self.tile_overlap >= self.tile_size:
            raise ValueError(f"tile_overlap = {self.tile_overlap} must be smaller than "
                             f"tile_size = {self.tile_size}; lower the overlap (e.g. "
                             f"{max(self.tile_size // 8 // m * m, 0)}) or raise the tile size")


# -- tile layout and blend weights ------------------------------------------------------------

@dataclass(frozen=True)
class _Span:
    """One tile along one axis: latent indices ``[start, stop)`` and the normalised blend
    weight of its output samples (``None``: the only tile on this axis, weight 1)."""

    start: int
    stop: int
    weight: Optional[Tensor]


def tile_starts(length: int, tile: int, overlap: int) -> List[int]:
    """First index of each tile covering ``[0, length)`` with tiles of ``tile`` advancing by
    ``tile - overlap``; the last tile is shifted back to end exactly at ``length`` (no padding
    beyond the image). A length up to one tile is a single tile ``[0, length)``."""
    if length <= tile:
        return [0]
    stride = tile - overlap
    count = -(-(length - tile) // stride) + 1
    return [min(i * stride, length - tile) for i in range(count)]


def _ramp(n: int) -> Tensor:
    """Raised-cosine fade-in over ``n`` samples, strictly inside (0, 1); ``_ramp(n)`` plus its
    mirror image is exactly 1, so two tiles fading over the same ``n`` samples sum to 1."""
    x = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    return torch.sin(0.5 * math.pi * x).square()


def _axis_spans(length: int, tile: int, overlap: int, scale: int,
                dtype: torch.dtype, device: torch.device) -> List[_Span]:
    """Tiles along one axis of ``length`` latents and their weights in output units
    (``scale`` output samples per latent: 1 for encoded latents, 8 for decoded pixels)."""
    starts = tile_starts(length, tile, overlap)
    size = min(tile, length)
    if len(starts) == 1:
        return [_Span(0, length, None)]
    n = size * scale
    raw = []
    for k, start in enumerate(starts):
        w = torch.ones(n, dtype=torch.float64)
        # Fade over the *actual* overlap with each neighbour: equal to ``overlap`` between
        # regular tiles, larger before the shifted last tile; both sides then fade over the
        # same samples and the blend stays a smooth partition of unity.
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


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


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


# -- argument checks --------------------------------------------------------------------------

def _check_settings(vae: VideoAutoencoder, tiles: TileSettings,
                    temporal_chunk: Optional[int]) -> None:
    if not isinstance(tiles, TileSettings):
        raise TypeError(f"tiles must be a TileSettings, got {type(tiles).__name__}")
    s = vae.spatial_factor
    if tiles.tile_size % s or tiles.tile_overlap % s:
        raise ValueError(f"tile_size = {tiles.tile_size} and tile_overlap = {tiles.tile_overlap} "
                         f"must be multiples of this VAE's spatial factor {s}")
    if temporal_chunk is not None:
        f = vae.temporal_factor
        if isinstance(temporal_chunk, bool) or not isinstance(temporal_chunk, int) \
                or temporal_chunk <= 0 or temporal_chunk % f:
            raise ValueError(f"temporal_chunk = {temporal_chunk!r}: must be a positive multiple "
                             f"of {f} video frames (the VAE's temporal factor; chunks are "
                             f"1 + {f}k frames, then {f}k), or None for no temporal slicing")


def _chunks(count: int, first: int, rest: int) -> List[Tuple[int, int]]:
    """``[0, count)`` cut into ``[0, first)``, then pieces of ``rest``."""
    bounds = [(0, min(first, count))]
    while bounds[-1][1] < count:
        start = bounds[-1][1]
        bounds.append((start, min(start + rest, count)))
    return bounds


def _layout(vae: VideoAutoencoder, tiles: TileSettings, h: int, w: int, scale: int,
            dtype: torch.dtype, device: torch.device) -> Tuple[List[_Span], List[_Span]]:
    if not tiles.enabled:
        return [_Span(0, h, None)], [_Span(0, w, None)]
    s = vae.spatial_factor
    size, overlap = tiles.tile_size // s, tiles.tile_overlap // s
    return (_axis_spans(h, size, overlap, scale, dtype, device),
            _axis_spans(w, size, overlap, scale, dtype, device))


# -- encode / decode --------------------------------------------------------------------------

def encode_posterior(vae: VideoAutoencoder, video: Tensor, tiles: TileSettings,
                     temporal_chunk: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """``vae.encode_posterior(video)`` in spatial tiles and/or causal temporal chunks.

    Same contract: ``video`` ``(B, 3, T, H, W)`` in [-1, 1] with ``T = 4n + 1`` and ``H, W``
    multiples of 8; returns ``(mean, logvar)``, each ``(B, 16, n + 1, H/8, W/8)`` in the VAE's
    dtype, ``logvar`` clamped to [-30, 20]. ``tiles`` tiles the input in pixels (moments are
    blended over ``tile_overlap / 8`` latents); ``temporal_chunk`` = ``c`` encodes frames in
    chunks of ``1 + c, c, c, ...`` (``c`` a multiple of 4; exact). Without either this is the
    plain call.
    """
    _check_settings(vae, tiles, temporal_chunk)
    if not tiles.enabled and temporal_chunk is None:
        return vae.encode_posterior(video)
    vae._check_video(video)
    B, _, T, H, W = video.shape
    s, f, dtype = vae.spatial_factor, vae.temporal_factor, vae.dtype
    h, w, t = H // s, W // s, (T - 1) // f + 1
    rows, cols = _layout(vae, tiles, h, w, 1, _accumulation_dtype(dtype), video.device)
    chunk = temporal_chunk if temporal_chunk is not None else T
    frame_chunks = _chunks(T, 1 + chunk, chunk)
    if len(rows) == len(cols) == len(frame_chunks) == 1:
        return vae.encode_posterior(video)

    shape = (B, vae.latent_channels, t, h, w)
    mean = torch.zeros(shape, dtype=dtype, device=video.device)
    logvar = torch.zeros(shape, dtype=dtype, device=video.device)
    for row in rows:
        for col in cols:
            weight = _tile_weight(row, col)
            cache = CausalCache() if len(frame_chunks) > 1 else None  # one per tile
            for f0, f1 in frame_chunks:
                # The slice is a strided view; .contiguous() copies just this piece.
                piece = video[:, :, f0:f1, row.start * s:row.stop * s,
                              col.start * s:col.stop * s].to(dtype).contiguous()
                moments = vae.encoder(piece, cache)
                del piece
                if vae.quant_conv is not None:  # 1x1x1: no temporal state
                    moments = vae.quant_conv(moments)
                m, lv = moments.chunk(2, dim=1)
                # Video frame 0 has latent frame 0; later chunks start at frame 1 + 4k -> k + 1.
                l0 = 0 if f0 == 0 else (f0 - 1) // f + 1
                region = (slice(None), slice(None), slice(l0, l0 + m.shape[2]),
                          slice(row.start, row.stop), slice(col.start, col.stop))
                _blend_into(mean, region, m, weight)
                # Clamp per tile, as the plain call does; a blend of clamped values stays inside.
                _blend_into(logvar, region, lv.clamp(LOGVAR_MIN, LOGVAR_MAX), weight)
                del moments, m, lv
    return mean, logvar


def encode(vae: VideoAutoencoder, video: Tensor, tiles: TileSettings,
           temporal_chunk: Optional[int] = None) -> Tensor:
    """The posterior mean from :func:`encode_posterior` (cf. ``vae.encode``)."""
    return encode_posterior(vae, video, tiles, temporal_chunk)[0]


def decode(vae: VideoAutoencoder, latent: Tensor, tiles: TileSettings,
           temporal_chunk: Optional[int] = None) -> Tensor:
    """``vae.decode(latent)`` in spatial tiles and/or causal temporal chunks.

    Same contract: ``latent`` ``(B, 16, t, h, w)`` unscaled, channels-first; returns video
    ``(B, 3, 4(t - 1) + 1, 8h, 8w)`` in the VAE's dtype. ``tiles`` tiles the latent
    (``tile_size / 8`` latents, ``tile_overlap / 8`` overlap) and blends decoded pixels over
    ``tile_overlap`` pixels; ``temporal_chunk`` = ``c`` decodes ``1 + c/4, c/4, ...`` latent
    frames at a time (= ``1 + c, c, ...`` output frames; exact). Without either this is the
    plain call.
    """
    _check_settings(vae, tiles, temporal_chunk)
    if not tiles.enabled and temporal_chunk is None:
        return vae.decode(latent)
    vae._check_latent(latent)
    B, _, t, h, w = latent.shape
    s, f, dtype = vae.spatial_factor, vae.temporal_factor, vae.dtype
    rows, cols = _layout(vae, tiles, h, w, s, _accumulation_dtype(dtype), latent.device)
    chunk = temporal_chunk // f if temporal_chunk is not None else t
    latent_chunks = _chunks(t, 1 + chunk, chunk)
    if len(rows) == len(cols) == len(latent_chunks) == 1:
        return vae.decode(latent)

    out = torch.zeros((B, vae.config.out_channels, f * (t - 1) + 1, h * s, w * s), dtype=dtype,
                      device=latent.device)
    for row in rows:
        for col in cols:
            weight = _tile_weight(row, col)
            cache = CausalCache() if len(latent_chunks) > 1 else None  # one per tile
            for l0, l1 in latent_chunks:
                z = latent[:, :, l0:l1, row.start:row.stop, col.start:col.stop] \
                    .to(dtype).contiguous()
                if vae.post_quant_conv is not None:  # 1x1x1: no temporal state
                    z = vae.post_quant_conv(z)
                piece = vae.decoder(z, cache)
                del z
                # Latent frame 0 decodes to video frame 0, latent frame k > 0 to 4k-3 .. 4k.
                v0 = 0 if l0 == 0 else f * (l0 - 1) + 1
                region = (slice(None), slice(None), slice(v0, v0 + piece.shape[2]),
                          slice(row.start * s, row.stop * s), slice(col.start * s, col.stop * s))
                _blend_into(out, region, piece, weight)
                del piece
    return out


__all__ = ["TileSettings", "encode_posterior", "encode", "decode", "tile_starts"]
