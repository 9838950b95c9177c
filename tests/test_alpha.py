"""RGBA alpha upscaling guided by the upscaled RGB."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seedvr2.pipeline import color as color_module
from seedvr2.pipeline.alpha import upscale_alpha

FG = torch.tensor([0.9, 0.3, 0.2]).view(1, 3, 1, 1)
BG = torch.tensor([0.1, 0.2, 0.6]).view(1, 3, 1, 1)


def _disc_scene(scale: int, size: int = 16, supersample: int = 8):
    """A hard-edged disc: alpha at input size (area-averaged), the anti-aliased truth at
    output size, and a two-colour RGB image whose edge is exactly the disc's."""
    n = size * scale * supersample
    coords = (torch.arange(n) + 0.5) / n
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    hard = (((yy - 0.49) ** 2 + (xx - 0.52) ** 2).sqrt() < 0.31).float()[None, None]
    truth = F.avg_pool2d(hard, supersample)
    alpha = F.avg_pool2d(hard, supersample * scale)
    rgb = truth * FG + (1 - truth) * BG
    return alpha, rgb, truth


def _transition_pixels(a):
    return ((a > 0.05) & (a < 0.95)).sum().item()


def test_shape_range_dtype():
    gen = torch.Generator().manual_seed(0)
    alpha = torch.rand(2, 1, 12, 16, generator=gen)
    rgb = torch.rand(2, 3, 48, 64, generator=gen)
    out = upscale_alpha(alpha, rgb)
    assert out.shape == (2, 1, 48, 64) and out.dtype == torch.float32
    assert out.min().item() >= 0.0 and out.max().item() <= 1.0
    out16 = upscale_alpha(alpha.to(torch.bfloat16), rgb.to(torch.bfloat16))
    assert out16.shape == (2, 1, 48, 64) and out16.dtype == torch.bfloat16
    # non-integer scale and shrinking work too
    assert upscale_alpha(alpha, torch.rand(2, 3, 30, 41, generator=gen)).shape == (2, 1, 30, 41)
    assert upscale_alpha(alpha, torch.rand(2, 3, 6, 8, generator=gen)).shape == (2, 1, 6, 8)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="alpha must be"):
        upscale_alpha(torch.zeros(1, 2, 4, 4), torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match="rgb must be"):
        upscale_alpha(torch.zeros(2, 1, 4, 4), torch.zeros(1, 3, 8, 8))


@pytest.mark.parametrize("value", [0.0, 1.0, 0.37])
def test_constant_alpha_stays_exact(value):
    rgb = torch.rand(3, 3, 40, 52, generator=torch.Generator().manual_seed(1))
    out = upscale_alpha(torch.full((3, 1, 10, 13), value), rgb)
    assert torch.equal(out, torch.full_like(out, value))


def test_opaque_and_transparent_regions_stay_exact():
    alpha, rgb, _ = _disc_scene(scale=4, size=32)
    out = upscale_alpha(alpha, rgb)
    # Output pixels whose source neighbourhood is fully inside / outside the disc.
    inside = F.interpolate((-F.max_pool2d(-alpha, 3, 1, 1) == 1.0).float(), scale_factor=4) > 0
    outside = F.interpolate((F.max_pool2d(alpha, 3, 1, 1) == 0.0).float(), scale_factor=4) > 0
    assert inside.sum() > 1000 and outside.sum() > 1000
    assert (out[inside] == 1.0).all() and (out[outside] == 0.0).all()


@pytest.mark.parametrize("scale", [2, 4])
def test_hard_edge_is_sharp_and_accurate(scale):
    alpha, rgb, truth = _disc_scene(scale)
    out = upscale_alpha(alpha, rgb)
    bilinear = F.interpolate(alpha, size=rgb.shape[-2:], mode="bilinear", align_corners=False)
    assert _transition_pixels(out) < 0.5 * _transition_pixels(bilinear)
    assert _transition_pixels(out) < 1.5 * _transition_pixels(truth)
    err, err_bilinear = (out - truth).abs().mean(), (bilinear - truth).abs().mean()
    assert err < 0.35 * err_bilinear


def test_edge_follows_the_rgb_edge():
    # The upscaled image puts the boundary 2 px to the right of where the alpha suggests;
    # the guided alpha moves toward it, plain interpolation cannot.
    alpha, rgb, truth = _disc_scene(scale=4)
    rgb, truth = torch.roll(rgb, 2, dims=-1), torch.roll(truth, 2, dims=-1)
    out = upscale_alpha(alpha, rgb)
    bicubic = F.interpolate(alpha, size=rgb.shape[-2:], mode="bicubic", align_corners=False)
    assert (out - truth).abs().mean() < 0.5 * (bicubic.clamp(0, 1) - truth).abs().mean()


def test_soft_matte_is_not_blurred_by_texture():
    # A smooth alpha ramp under noisy RGB: the guide explains nothing, so the result
    # stays as good as plain bicubic interpolation (no extra blur, no texture imprint).
    gen = torch.Generator().manual_seed(2)
    n, scale, ss = 32, 4, 8
    axis = torch.linspace(0, 1, n * scale * ss)
    yy, xx = torch.meshgrid(axis, axis, indexing="ij")
    fine = (0.5 + 0.45 * torch.sin(6 * xx + 3 * yy))[None, None]
    truth, alpha = F.avg_pool2d(fine, ss), F.avg_pool2d(fine, ss * scale)
    rgb = (0.5 + 0.1 * torch.randn(1, 3, n * scale, n * scale, generator=gen)).clamp(0, 1)
    out = upscale_alpha(alpha, rgb)
    bicubic = F.interpolate(alpha, size=rgb.shape[-2:], mode="bicubic", align_corners=False)
    assert (out - truth).abs().mean() < 1.25 * (bicubic - truth).abs().mean()


def test_deterministic(monkeypatch):
    alpha, rgb, _ = _disc_scene(scale=3)
    rgb = rgb + 0.05 * torch.rand(rgb.shape, generator=torch.Generator().manual_seed(3))
    single = upscale_alpha(alpha, rgb)
    assert torch.equal(single, upscale_alpha(alpha, rgb))
    # A frame's result does not depend on the frames processed with it, nor on chunking.
    both = upscale_alpha(alpha.expand(2, -1, -1, -1), rgb.expand(2, -1, -1, -1))
    assert torch.equal(both[0:1], single) and torch.equal(both[1:2], single)
    monkeypatch.setattr(color_module, "_CHUNK_PIXELS", 1)  # alpha chunks as colour does
    chunked = upscale_alpha(alpha.expand(2, -1, -1, -1), rgb.expand(2, -1, -1, -1))
    assert torch.equal(chunked, both)
