"""VAE spatial tiling and causal temporal slicing (``seedvr2.memory.tiling``).

Four kinds of checks:

* exact-mode spatial tiling (the default) equals the untiled result of the real architecture
  (tiny conformance VAE) up to float rounding (``network_bound``), alone and with temporal
  slicing, and its convolutions only ever see one tile plus its halo;
* the fast mode's *machinery* (tile layout, feathered weights, placement in space and time)
  is exact for a VAE whose encoder and decoder are local (each latent depends on its own 8x8
  pixel cell only): there a tiled result must equal the untiled one up to rounding;
* causal temporal slicing is exact for the real architecture;
* fast-mode tiling of the real architecture is an approximation: its distance to the untiled
  result is measured and bounded (``TILED_BOUND``).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from seedvr2.memory import tiling
from seedvr2.memory.tiling import (
    TileSettings,
    decode,
    encode,
    encode_posterior,
    settings_from_options,
    tile_layout,
)
from seedvr2.models import build_vae
from seedvr2.models.vae import VideoAutoencoder
from seedvr2.options import OptionError, resolve_options

from conftest import network_bound, rounding_bound

# Temporal slicing and exact-mode tiling compute the untiled sums over other tensor shapes, so
# they may round them in another order: conftest.network_bound of the encoder (for means and
# logvars) or the decoder (for pixels) bounds the difference (measured: slicing 0 - 8e-6,
# exact tiling 8e-7 - 2e-6 of the output's magnitude).
FAST = dict(exact=False)
# The local VAE's sums: 8x8 pooling (64 terms), the frame-group mean, a pointwise conv, then
# the blend of at most 4 overlapping tiles.
LOCAL_SUMS = dict(terms=64, layers=4)


def encoder_bound(vae, reference) -> float:
    return network_bound(vae.encoder, reference)


def decoder_bound(vae, reference) -> float:
    return network_bound(vae.decoder, reference)


@pytest.fixture(scope="module")
def tiny_vae(conformance) -> VideoAutoencoder:
    root = conformance / "vae_tiny"
    config = json.loads((root / "config.json").read_text())["constructor_kwargs"]
    model = build_vae(config).eval()
    model.load_state_dict(load_file(root / "weights.safetensors"), strict=True)
    return model


@pytest.fixture(scope="module")
def golden(conformance) -> dict:
    return {name: load_file(conformance / "vae_tiny" / "cases" / f"{name}.safetensors")
            for name in ("video_9f", "image_1f")}


def smooth_video(shape, seed: int = 0, cell: int = 16) -> torch.Tensor:
    """A smooth video in [-1, 1]: random values on a coarse grid, bicubic upsampled (natural
    images are smooth at the tile scale; white noise would exaggerate border effects)."""
    B, C, T, H, W = shape
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(B * C, T, H // cell + 1, W // cell + 1, generator=g) * 2 - 1
    fine = F.interpolate(coarse, size=(H, W), mode="bicubic", align_corners=True)
    return fine.view(B, C, T, H, W).clamp(-1, 1)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- settings ---------------------------------------------------------------------------------

def test_default_settings_are_disabled_and_valid():
    assert TileSettings() == TileSettings(enabled=False, tile_size=512, tile_overlap=64,
                                          exact=True, state_device="cpu")


@pytest.mark.parametrize("kwargs, match", [
    (dict(tile_size=100), r"tile_size = 100: must be a positive multiple of 8 .* use 96 or 104"),
    (dict(tile_size=4, tile_overlap=0), r"tile_size = 4: .*multiple of 8.* use 8"),
    (dict(tile_size=0), r"tile_size = 0: must be a positive multiple of 8"),
    (dict(tile_overlap=20), r"tile_overlap = 20: must be a multiple of 8 .* use 16 or 24"),
    (dict(tile_overlap=-8), r"tile_overlap = -8: must be a multiple of 8 pixels >= 0"),
    (dict(tile_size=64, tile_overlap=64),
     r"tile_overlap = 64 must be smaller than tile_size = 64; lower the overlap"),
    (dict(tile_size=64, tile_overlap=128),
     r"tile_overlap = 128 must be smaller than tile_size = 64"),
    (dict(tile_size=512.0), r"tile_size must be an int number of pixels, got 512.0"),
    (dict(exact="yes"), r"exact must be True or False, got 'yes'"),
    (dict(state_device="disk"), r"state_device = 'disk': expected a device such as 'cpu'"),
])
def test_bad_tile_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TileSettings(enabled=True, **kwargs)


@pytest.mark.parametrize("chunk", [0, 3, 6, -4, 4.0])
def test_bad_temporal_chunk_is_rejected(tiny_vae, chunk):
    video = torch.zeros(1, 3, 5, 16, 16)
    with pytest.raises(ValueError, match=r"temporal_chunk = .*: must be a positive multiple of 4"):
        encode_posterior(tiny_vae, video, TileSettings(), chunk)
    with pytest.raises(ValueError, match=r"temporal_chunk = .*: must be a positive multiple of 4"):
        decode(tiny_vae, torch.zeros(1, 16, 2, 2, 2), TileSettings(), chunk)


def test_bad_shapes_are_rejected_like_the_plain_call(tiny_vae):
    tiles = TileSettings(enabled=True, tile_size=32, tile_overlap=16)
    with pytest.raises(ValueError, match=r"video frame count T must be 4n\+1.*got T=4"):
        encode_posterior(tiny_vae, torch.zeros(1, 3, 4, 64, 64), tiles)
    with pytest.raises(ValueError, match=r"multiples of 8.*W=60"):
        encode_posterior(tiny_vae, torch.zeros(1, 3, 5, 64, 60), tiles, 4)
    with pytest.raises(ValueError, match=r"latent must have 16 channels"):
        decode(tiny_vae, torch.zeros(1, 8, 2, 8, 8), tiles)


# -- tile layout ------------------------------------------------------------------------------

@pytest.mark.parametrize("length, tile, overlap, expected", [
    (5, 8, 2, ([0], 5)),                 # smaller than a tile: one tile [0, 5)
    (8, 8, 2, ([0], 8)),                 # exactly one tile
    (14, 8, 2, ([0, 6], 8)),             # tiles fit exactly
    (15, 8, 2, ([0, 4, 8], 7)),          # three tiles of 7, not 8 with the last shifted back
    (25, 8, 6, ([0, 1, 3, 5, 7, 9, 11, 13, 15, 17], 8)),  # overlap > tile / 2
    (17, 4, 0, ([0, 3, 6, 9, 13], 4)),   # no overlap: 3 or 4 apart
    (136, 64, 8, ([0, 42, 85], 51)),     # 1080p in latents, 512-px tiles, 64-px overlap
    (240, 64, 8, ([0, 46, 92, 138, 185], 55)),  # 1920 px
])
def test_tile_layout(length, tile, overlap, expected):
    assert tile_layout(length, tile, overlap) == expected


@settings(max_examples=300)
@given(length=st.integers(1, 400), tile=st.integers(1, 80), overlap=st.integers(0, 79))
def test_tile_layout_covers_evenly_with_the_least_work(length, tile, overlap):
    """Tiles cover [0, length) exactly, neighbours share at least the overlap, no tile is
    larger than asked, and no layout of as few tiles could be smaller (the work a frame
    costs), nor could fewer tiles do."""
    assume(overlap < tile)
    starts, size = tile_layout(length, tile, overlap)
    n = len(starts)
    assert size <= tile and starts[0] == 0 and starts[-1] + size == length
    assert all(0 < b - a <= size - overlap for a, b in zip(starts, starts[1:]))
    assert n == 1 or (n - 1) * (tile - overlap) + overlap < length  # n - 1 tiles cannot
    assert n == 1 or (size - 1) * n - (n - 1) * overlap < length  # nor n smaller ones


# -- fast mode: the machinery, exact with a local VAE -----------------------------------------

class LocalEncoder(nn.Module):
    """Causal and spatially local: a latent sees its own 8x8 cell of its frame group only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv3d(3, 32, 1)  # also gives the VAE its dtype

    def forward(self, x, cache=None):
        first = cache is None or cache.first_visit(self)
        head, body = (x[:, :, :1], x[:, :, 1:]) if first else (x[:, :, :0], x)
        B, C, T, H, W = body.shape
        x = torch.cat([head, body.reshape(B, C, T // 4, 4, H, W).mean(3)], dim=2)
        x = x.reshape(B, C, -1, H // 8, 8, W // 8, 8).mean((4, 6))  # 8x8 average pooling
        return torch.tanh(self.conv_in(x)) * 3


class LocalDecoder(nn.Module):
    """Latent frame 0 -> one frame, each later one -> 4; each latent -> its 8x8 cell."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(16, 3, 1)

    def forward(self, z, cache=None):
        first = cache is None or cache.first_visit(self)
        x = torch.sin(self.conv(z)).repeat_interleave(8, 3).repeat_interleave(8, 4)
        x = x.repeat_interleave(4, 2)
        return x[:, :, 3:] if first else x  # frame 0 once, not four times


@pytest.fixture(scope="module")
def local_vae(tiny_vae) -> VideoAutoencoder:
    torch.manual_seed(0)
    model = copy.deepcopy(tiny_vae)
    model.encoder, model.decoder = LocalEncoder(), LocalDecoder()
    return model.eval()


@pytest.mark.parametrize("shape, tile, overlap, chunk", [
    ((1, 3, 5, 64, 96), 32, 16, None),    # both axes tiled, tiles fit exactly
    ((2, 3, 9, 72, 104), 32, 8, 4),       # last tiles shifted, batch 2, temporal chunks
    ((1, 3, 1, 40, 200), 64, 48, None),   # overlap > tile/2: 3+ tiles over some columns
    ((1, 3, 13, 64, 136), 32, 0, 8),      # no overlap; chunks 9, 4
    ((1, 3, 9, 24, 40), 512, 64, 4),      # smaller than one tile, temporal chunks only
    ((1, 3, 5, 200, 40), 64, 16, None),   # only rows tiled
])
def test_tiling_is_exact_for_a_local_vae(local_vae, shape, tile, overlap, chunk):
    video = torch.rand(shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
    tiles = TileSettings(enabled=True, tile_size=tile, tile_overlap=overlap, **FAST)
    with torch.no_grad():
        mean, logvar = local_vae.encode_posterior(video)
        tiled_mean, tiled_logvar = encode_posterior(local_vae, video, tiles, chunk)
        decoded = local_vae.decode(mean)
        tiled_decoded = decode(local_vae, mean, tiles, chunk)
    assert tiled_mean.shape == mean.shape and tiled_decoded.shape == decoded.shape == video.shape
    # The blend weights sum to 1 everywhere and every piece lands where it belongs.
    assert max_abs(tiled_mean, mean) < rounding_bound(mean, **LOCAL_SUMS)
    assert max_abs(tiled_logvar, logvar) < rounding_bound(logvar, **LOCAL_SUMS)
    assert max_abs(tiled_decoded, decoded) < rounding_bound(decoded, **LOCAL_SUMS)


def test_reduced_precision_accumulates_in_float32(local_vae):
    model = copy.deepcopy(local_vae).to(torch.bfloat16)
    video = torch.rand(1, 3, 5, 40, 72, generator=torch.Generator().manual_seed(2)) * 2 - 1
    tiles = TileSettings(enabled=True, tile_size=32, tile_overlap=16, **FAST)
    with torch.no_grad():
        mean = model.encode(video)
        tiled = encode(model, video, tiles)
        decoded = decode(model, mean, tiles)
    assert tiled.dtype == decoded.dtype == torch.bfloat16
    # One bf16 rounding of the blended value: within 1 ulp (2^-7 relative) of the plain call,
    # plus the float32 blend's own rounding (decoded pixels are sines: magnitude 1).
    blend = rounding_bound(mean.float(), **LOCAL_SUMS)
    assert ((tiled.float() - mean.float()).abs() <= mean.float().abs() * 2 ** -7 + blend).all()
    assert ((decoded.float() - model.decode(mean).float()).abs()
            <= 2 ** -7 + rounding_bound(1.0, **LOCAL_SUMS)).all()


# -- plain path and small images: bit-identical -----------------------------------------------

@pytest.fixture(scope="module")
def plain_image(tiny_vae, golden) -> dict:
    case = golden["image_1f"]  # (1, 3, 1, 40, 56)
    with torch.no_grad():
        mean, logvar = tiny_vae.encode_posterior(case["inputs.video"])
        decoded = tiny_vae.decode(case["outputs.posterior_mean"])
    return dict(video=case["inputs.video"], latent=case["outputs.posterior_mean"], mean=mean,
                logvar=logvar, decoded=decoded)


@pytest.mark.parametrize("tiles, chunk", [
    (TileSettings(), None),
    (TileSettings(enabled=False, tile_size=32, tile_overlap=16), None),
    (TileSettings(enabled=True, tile_size=512, tile_overlap=64), None),  # image < one tile
    (TileSettings(enabled=True, tile_size=56, tile_overlap=8), 4),       # tile = image, 1 chunk
], ids=["default", "disabled", "image_smaller_than_tile", "tile_fits_image_one_chunk"])
def test_single_pass_is_bit_identical_to_the_plain_call(tiny_vae, plain_image, tiles, chunk):
    with torch.no_grad():
        mean, logvar = encode_posterior(tiny_vae, plain_image["video"], tiles, chunk)
        decoded = decode(tiny_vae, plain_image["latent"], tiles, chunk)
    assert torch.equal(mean, plain_image["mean"]) and torch.equal(logvar, plain_image["logvar"])
    assert torch.equal(decoded, plain_image["decoded"])


# -- causal temporal slicing: exact -----------------------------------------------------------

@pytest.mark.parametrize("frames, chunk", [(9, 4), (17, 8)])
def test_temporal_slicing_matches_the_single_pass(tiny_vae, golden, frames, chunk):
    # 9 frames in chunks of 4: encode 5 + 4 frames, decode 2 + 1 latent frames (the official
    # split); 17 in chunks of 8: encode 9 + 8, decode 3 + 2. A spatial crop keeps this cheap.
    if frames == 9:
        video = golden["video_9f"]["inputs.video"][:, :, :, :16, :24]
    else:
        video = smooth_video((1, 3, frames, 16, 16), seed=frames)
    with torch.no_grad():
        mean, logvar = tiny_vae.encode_posterior(video)
        decoded = tiny_vae.decode(mean)
        sliced_mean, sliced_logvar = encode_posterior(tiny_vae, video, TileSettings(), chunk)
        sliced_decoded = decode(tiny_vae, mean, TileSettings(), chunk)
    assert sliced_mean.shape == mean.shape and sliced_decoded.shape == decoded.shape
    assert max_abs(sliced_mean, mean) < encoder_bound(tiny_vae, mean)
    assert max_abs(sliced_logvar, logvar) < encoder_bound(tiny_vae, logvar)
    assert max_abs(sliced_decoded, decoded) < decoder_bound(tiny_vae, decoded)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_temporal_slicing_inside_tiles_matches_unsliced_tiles(tiny_vae, exact):
    video = smooth_video((1, 3, 9, 16, 32), seed=3)
    tiles = TileSettings(enabled=True, tile_size=16, tile_overlap=8, exact=exact)  # 2-3 across
    with torch.no_grad():
        mean, logvar = encode_posterior(tiny_vae, video, tiles)
        decoded = decode(tiny_vae, mean, tiles)
        sliced_mean, sliced_logvar = encode_posterior(tiny_vae, video, tiles, 4)
        sliced_decoded = decode(tiny_vae, mean, tiles, 4)
    assert max_abs(sliced_mean, mean) < encoder_bound(tiny_vae, mean)
    assert max_abs(sliced_logvar, logvar) < encoder_bound(tiny_vae, logvar)
    assert max_abs(sliced_decoded, decoded) < decoder_bound(tiny_vae, decoded)


# -- fast-mode spatial tiling of the real architecture: approximate, bounded -------------------

# Tiled vs untiled on the tiny conformance VAE (random weights), smooth 96x96 frame, 64-px
# tiles with 32-px overlap (2 x 2 tiles of 8 x 8 latents), max abs / mean abs measured:
#   posterior mean 1.01 / 0.146, logvar 0.99 / 0.144  (latents: std 0.58)
#   decoded        2.24 / 0.215                        (pixels: mean abs 0.43, range +-9)
# The bounds below leave ~1.5x margin. The error is not concentrated at the seams: it comes
# mostly from GroupNorm statistics taken per tile instead of per frame (global; the mid-block
# attention contributes little) and from the zero-padded tile borders (~6 latents reach).
# Larger tiles shrink it: at the default 512/64 on a 768x768 frame (2 x 2 tiles) it measured
# 0.30 / 0.015 on the posterior mean and 1.38 / 0.031 decoded.
TILED_BOUND = {"mean": (1.5, 0.22), "logvar": (1.5, 0.22), "decoded": (3.4, 0.32)}


def test_fast_tiled_output_stays_close_to_untiled(tiny_vae):
    video = smooth_video((1, 3, 1, 96, 96))
    tiles = TileSettings(enabled=True, tile_size=64, tile_overlap=32, **FAST)
    with torch.no_grad():
        mean, logvar = tiny_vae.encode_posterior(video)
        decoded = tiny_vae.decode(mean)
        tiled_mean, tiled_logvar = encode_posterior(tiny_vae, video, tiles)
        tiled_decoded = decode(tiny_vae, mean, tiles)
    errors = {"mean": tiled_mean - mean, "logvar": tiled_logvar - logvar,
              "decoded": tiled_decoded - decoded}
    for name, error in errors.items():
        worst, average = error.abs().max().item(), error.abs().mean().item()
        max_bound, mean_bound = TILED_BOUND[name]
        assert worst < max_bound and average < mean_bound, \
            f"{name}: tiled vs untiled max abs {worst:.3g}, mean abs {average:.3g}"


# -- exact-mode spatial tiling: equal to untiled up to float rounding -------------------------

def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return max_abs(actual.float(), expected.float()) / expected.float().abs().max().item()


@pytest.mark.parametrize("shape, tile, chunk", [
    ((1, 3, 1, 96, 96), 32, None),      # 3 x 3 tiles, one frame
    ((2, 3, 5, 64, 80), 32, None),      # batch 2, last column narrower (80 = 32 + 32 + 16)
    ((2, 3, 9, 64, 48), 16, 4),         # 2-latent tiles, chunks 5 + 4 (carried planes), B 2
    ((1, 3, 13, 48, 40), 24, 8),        # tiles of 3 latents, chunks 9 + 4
    ((1, 3, 5, 200, 40), 64, None),     # only rows tiled
], ids=["image_3x3", "batch2", "sliced_4", "sliced_8", "rows_only"])
def test_exact_tiling_matches_untiled(tiny_vae, shape, tile, chunk):
    video = smooth_video(shape, seed=sum(shape))
    tiles = TileSettings(enabled=True, tile_size=tile, tile_overlap=8)
    with torch.no_grad():
        mean, logvar = tiny_vae.encode_posterior(video)
        decoded = tiny_vae.decode(mean)
        tiled_mean, tiled_logvar = encode_posterior(tiny_vae, video, tiles, chunk)
        tiled_decoded = decode(tiny_vae, mean, tiles, chunk)
    assert tiled_mean.shape == mean.shape and tiled_decoded.shape == decoded.shape
    assert max_abs(tiled_mean, mean) < encoder_bound(tiny_vae, mean)
    assert max_abs(tiled_logvar, logvar) < encoder_bound(tiny_vae, logvar)
    assert max_abs(tiled_decoded, decoded) < decoder_bound(tiny_vae, decoded)


def test_exact_tiling_with_quant_convs_and_state_on_the_vae_device(tiny_vae):
    model = copy.deepcopy(tiny_vae)
    model.quant_conv = nn.Conv3d(32, 32, 1)  # pointwise stand-ins for the optional layers
    model.post_quant_conv = nn.Conv3d(16, 16, 1)
    video = smooth_video((1, 3, 5, 48, 64), seed=5)
    tiles = TileSettings(enabled=True, tile_size=16, tile_overlap=0, state_device=None)
    with torch.no_grad():
        mean, logvar = model.encode_posterior(video)
        tiled_mean, tiled_logvar = encode_posterior(model, video, tiles)
        decoded, tiled_decoded = model.decode(mean), decode(model, mean, tiles, 4)
    # The pointwise quant convs add one 32-term sum to the encoder and a 16-term one to the
    # decoder: within the bounds of the 864-term convolutions around them.
    assert max_abs(tiled_mean, mean) < encoder_bound(model, mean)
    assert max_abs(tiled_logvar, logvar) < encoder_bound(model, logvar)
    assert max_abs(tiled_decoded, decoded) < decoder_bound(model, decoded)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_tiling_in_reduced_precision_is_within_its_rounding(tiny_vae, dtype):
    # Planes are stored in the model dtype, where the untiled model rounds too; what differs is
    # the summation order inside convolutions, so the difference is rounding noise: tiled and
    # untiled carry independent roundings of the same size, so they differ by about sqrt(2)
    # times the untiled model's distance from float32; 1.5 > sqrt(2) (measured 0.6-0.9).
    model = copy.deepcopy(tiny_vae).to(dtype)
    video = smooth_video((1, 3, 5, 64, 96), seed=4)
    tiles = TileSettings(enabled=True, tile_size=32, tile_overlap=0)
    with torch.no_grad():
        mean = model.encode(video)
        tiled = encode(model, video, tiles)
        decoded, tiled_decoded = model.decode(mean), decode(model, mean, tiles)
        mean32, decoded32 = tiny_vae.encode(video), tiny_vae.decode(mean.float())
    assert tiled.dtype == tiled_decoded.dtype == dtype
    assert relative_error(tiled, mean) <= 1.5 * relative_error(mean, mean32)
    assert relative_error(tiled_decoded, decoded) <= 1.5 * relative_error(decoded, decoded32)


def test_exact_tiling_convolves_one_tile_at_a_time(tiny_vae, monkeypatch):
    """The memory claim: every convolution input is one tile plus its halo, however large the
    frame (tile edges are ``tile_size`` pixels of the video at every level)."""
    seen = []
    conv3d = F.conv3d

    def spy(x, *args, **kwargs):
        seen.append(tuple(x.shape[-2:]))
        return conv3d(x, *args, **kwargs)

    monkeypatch.setattr(tiling.F, "conv3d", spy)
    video = smooth_video((1, 3, 1, 160, 192), seed=6)
    latent = torch.randn(1, 16, 1, 20, 24, generator=torch.Generator().manual_seed(6))
    tiles = TileSettings(enabled=True, tile_size=32, tile_overlap=0)
    with torch.no_grad():
        encode(tiny_vae, video, tiles)
        decode(tiny_vae, latent, tiles)
    assert len(seen) > 1000
    # At most the tile (32 pixels at full resolution, 16 at half, ...) plus a 3x3 halo.
    assert max(h for h, _ in seen) <= 32 + 2 and max(w for _, w in seen) <= 32 + 2


# -- options ----------------------------------------------------------------------------------

def test_settings_from_options():
    opts = resolve_options(vae_encode_tiled=True, vae_encode_tile_size=256,
                           vae_encode_tile_overlap=32, vae_encode_temporal_slice=0,
                           vae_decode_temporal_slice=8)
    assert settings_from_options(opts, "encode") == (TileSettings(True, 256, 32, exact=False), None)
    assert settings_from_options(opts, "decode") == (TileSettings(False, 512, 64, exact=False), 8)
    exact = resolve_options(vae_decode_tiled=True, vae_tiling_exact=True)
    assert settings_from_options(exact, "decode") == (TileSettings(True, 512, 64, exact=True), 4)
    with pytest.raises(ValueError, match="stage must be 'encode' or 'decode'"):
        settings_from_options(opts, "both")


@pytest.mark.parametrize("name", ["vae_encode_temporal_slice", "vae_decode_temporal_slice"])
def test_temporal_slice_options_are_validated(name):
    assert getattr(resolve_options(), name) == 4  # the official pipeline's slices
    assert getattr(resolve_options(**{name: 0}), name) == 0
    with pytest.raises(OptionError, match=rf"{name} = 6: must be a multiple of 4 frames "
                                          r"\(e.g. 4\), or 0 for no slicing"):
        resolve_options(**{name: 6})
    with pytest.raises(OptionError, match=rf"{name} = -4: must be at least 0"):
        resolve_options(**{name: -4})


def test_temporal_slice_option_gives_the_same_result(tiny_vae):
    video = smooth_video((1, 3, 9, 16, 24), seed=7)
    encode_tiles, encode_slice = settings_from_options(
        resolve_options(vae_encode_temporal_slice=4), "encode")
    decode_tiles, decode_slice = settings_from_options(
        resolve_options(vae_decode_temporal_slice=4), "decode")
    assert encode_slice == decode_slice == 4
    with torch.no_grad():
        mean = tiny_vae.encode(video)
        sliced = encode(tiny_vae, video, encode_tiles, encode_slice)
        decoded = decode(tiny_vae, mean, decode_tiles, decode_slice)
        plain = tiny_vae.decode(mean)
        assert max_abs(sliced, mean) < encoder_bound(tiny_vae, mean)
        assert max_abs(decoded, plain) < decoder_bound(tiny_vae, plain)
