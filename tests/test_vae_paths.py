"""The VAE's kernel paths (issue #36) on the CPU: comfy-kitchen's eager backend, every call
checked against the CUDA kernel's preconditions (tests/kernel_checks.capable_gpu), each path
against today's with a bound derived per op, and each bound shown to catch a deliberate
mistake (statistics of the wrong frames, padding on the wrong side, a dropped residual)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from seedvr2.models import vae_paths
from seedvr2.models.vae_blocks import (
    CausalCache,
    CausalConv3d,
    ConvSpec,
    FrameGroupNorm,
    ResnetBlock3D,
    conv3d_in_bands,
    norm_silu_into,
)
from seedvr2.models.vae_paths import TODAY, PackedTail, VaePaths, choose_paths

from conftest import low_precision_bound, rounding_bound
from kernel_checks import capable_gpu
from test_vae import load_case, tiny_vae  # noqa: F401  (fixture)

ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen not installed")
F16 = torch.float16
FUSED = VaePaths(fused_norm=True)
FP16 = VaePaths(fp16_accumulation=True)


def _frames(shape, dtype, seed=0) -> torch.Tensor:
    """Activations whose frames have clearly different statistics (so stats taken from the
    wrong frame show), in ``dtype``."""
    torch.manual_seed(seed)
    B, C, T = shape[:3]
    offsets = torch.arange(B * T, dtype=torch.float32).view(B, 1, T, 1, 1)
    return (torch.randn(shape) * (1 + offsets) + 3 * offsets).to(dtype)


def _norm(channels=16, groups=4, seed=1) -> FrameGroupNorm:
    torch.manual_seed(seed)
    norm = FrameGroupNorm(groups, channels, eps=1e-6)
    norm.weight.data.normal_()
    norm.bias.data.normal_()
    return norm.requires_grad_(False)


def _fused_norm_bound(norm, x) -> tuple[torch.Tensor, float]:
    """Today's ``silu(norm(x))`` and the bound of the fused op's difference from it: both
    normalise in float32 (the shift's float32 rounding differs: far below the output's), so
    the normalised value ``v`` may round to a neighbouring ``x.dtype`` value (|dv| <= eps·|v|);
    SiLU (slope at most 1.1) then moves the output by at most 1.1·eps·|v|, and its own rounding
    by at most eps·|silu(v)|."""
    with torch.inference_mode():
        v = norm(x)
        today = F.silu(v)
    eps = torch.finfo(x.dtype).eps
    return today, eps * (1.1 * v.abs().max().item() + today.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_fused_norm_matches_today_within_two_roundings(dtype, in_place):
    norm, x = _norm(), _frames((2, 16, 3, 8, 8), dtype)
    today, bound = _fused_norm_bound(norm, x)
    with capable_gpu((12, 0), check_products=False) as log, torch.inference_mode():
        out = x.clone() if in_place else torch.empty_like(x)
        norm_silu_into(norm, out if in_place else x, out, None, FUSED)
    assert log.calls["comfy_kitchen.group_norm_silu_pad3d"] == (3 if in_place else 1)
    assert (out.float() - today.float()).abs().max().item() <= bound


def test_fused_norm_with_stats_of_the_wrong_frames_fails_the_bound(monkeypatch):
    """Rows group-major instead of frame-major: each frame normalised with another's stats."""
    norm, x = _norm(), _frames((2, 16, 3, 8, 8), F16)
    today, bound = _fused_norm_bound(norm, x)

    def wrong_frames(mean, var, eps):
        B, G, _, T = mean.shape
        pair = torch.stack((mean.float(), torch.rsqrt(var.float() + eps)), dim=-1)
        return pair.reshape(B * T, G, 2)  # (B, G, T) read as (B, T, G)
    monkeypatch.setattr(vae_paths, "kitchen_stats", wrong_frames)
    with capable_gpu((12, 0), check_products=False), torch.inference_mode():
        out = torch.empty_like(x)
        norm_silu_into(norm, x, out, None, FUSED)
    assert (out.float() - today.float()).abs().max().item() > 100 * bound


def _conv_bound(weight, x, reference, *, with_input_error: float = 0.0) -> float:
    """fp16 convolutions on the CPU accumulate in float32 whatever the call's shape: a
    float32 sum of ``C·k³`` terms reassociated (conftest.rounding_bound), then one rounding of
    the output to fp16 that may go the other way (eps·|out|); ``with_input_error``: a bound on
    each input element's difference, times the largest filter's absolute sum."""
    terms = weight[0].numel()
    magnitude = (x.float().abs().max() * weight.float().abs().flatten(1).sum(1).max()).item()
    return (rounding_bound(magnitude, terms=terms)
            + torch.finfo(F16).eps * reference.float().abs().max().item()
            + with_input_error * weight.float().abs().flatten(1).sum(1).max().item())


@pytest.mark.parametrize("limit", [1 << 30, 600])
def test_fp16_conv_matches_today(limit):
    torch.manual_seed(2)
    x = torch.randn(1, 4, 5, 23, 9).half()
    weight, bias = torch.randn(6, 4, 3, 3, 3).half() * 0.2, torch.randn(6).half()
    today = conv3d_in_bands(x, ConvSpec(weight, bias, (1, 1, 1), (0, 1, 1)), limit=limit)
    with capable_gpu((12, 0), check_products=False) as log:
        fp16 = conv3d_in_bands(x, ConvSpec(weight, bias, (1, 1, 1), (0, 1, 1), FP16), limit=limit)
    calls = log.calls["comfy_kitchen.fp16_conv3d"]
    assert calls == 1 if limit > 1000 else calls > 3  # one call, or bands
    assert (fp16.float() - today.float()).abs().max().item() <= _conv_bound(weight, x, today)


def test_fp16_conv_padded_on_the_wrong_side_fails_the_bound(monkeypatch):
    """An edge band padded at the far edge (top and bottom swapped): rows off by one."""
    torch.manual_seed(2)
    x = torch.randn(1, 4, 5, 23, 9).half()
    weight, bias = torch.randn(6, 4, 3, 3, 3).half() * 0.2, torch.randn(6).half()
    today = conv3d_in_bands(x, ConvSpec(weight, bias, (1, 1, 1), (0, 1, 1)), limit=600)
    real = vae_paths.fp16_conv3d

    def swapped(x, weight, bias, stride, pad, residual=None):
        left, right, top, bottom, front, back = pad
        return real(x, weight, bias, stride, (left, right, bottom, top, front, back), residual)
    monkeypatch.setattr(vae_paths, "fp16_conv3d", swapped)
    with capable_gpu((12, 0), check_products=False):
        wrong = conv3d_in_bands(x, ConvSpec(weight, bias, (1, 1, 1), (0, 1, 1), FP16), limit=600)
    assert (wrong.float() - today.float()).abs().max().item() > 10 * _conv_bound(weight, x, today)


def _block(seed=3) -> ResnetBlock3D:
    torch.manual_seed(seed)
    block = ResnetBlock3D(8, 16, groups=4)
    for norm in (block.norm1, block.norm2):
        norm.weight.data.normal_()
        norm.bias.data.normal_()
    return block.half().requires_grad_(False)


def _set_paths(module, paths):
    for m in module.modules():
        if isinstance(m, CausalConv3d):
            m.paths = paths


def _rel_l2(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp16_block_fuses_the_shortcut_and_a_dropped_residual_fails(monkeypatch):
    """The residual block on the fp16 path (the shortcut in conv2's epilogue): within two fp16
    runs' bound of today's (each within conftest.low_precision_bound of float32 through its
    three convolutions); the kernel called without the residual is O(1) off."""
    block, x = _block(), _frames((1, 8, 3, 8, 8), F16)
    with torch.inference_mode():
        today = block(x)
        _set_paths(block, FP16)
        with capable_gpu((12, 0), check_products=False) as log:
            fused = block(x)
        assert log.calls["comfy_kitchen.fp16_conv3d"] == 3  # shortcut, conv1, conv2
        bound = 2 * low_precision_bound(F16, 3)
        assert _rel_l2(fused, today) <= bound
        real = ck.fp16_conv3d
        monkeypatch.setattr(ck, "fp16_conv3d", lambda x, w, b=None, residual=None, stride=1:
                            real(x, w, b, None, stride))
        with capable_gpu((12, 0), check_products=False):
            dropped = block(x)
    assert _rel_l2(dropped, today) > 10 * bound


def test_int8_tail_round_trip_within_half_a_step():
    """Per-tensor int8 (scale = absmax / 127): each value within half a step, plus its rounding
    back to the tail's dtype; tails under the size stay as they are."""
    tail = _frames((1, 16, 2, 8, 8), F16)
    packed = PackedTail.pack(tail)
    assert packed.codes.dtype == torch.int8 and packed.scale.numel() == 1
    back = packed.unpack()
    step = tail.float().abs().max().item() / 127
    eps = torch.finfo(F16).eps
    error = (back.float() - tail.float()).abs()
    assert (error <= step / 2 * (1 + 1e-6) + eps * tail.float().abs()).all()
    assert error.max().item() > step / 8  # int8 for real, not a copy
    cache = CausalCache(paths=VaePaths(int8_cache_bytes=tail.numel() * 2 + 1))
    conv = CausalConv3d(16, 16, 3, padding=1)
    cache.set_tail(conv, tail)
    assert torch.equal(cache.tail(conv), tail)  # under the size: kept as is


def test_paths_are_logged_and_fp16_accumulation_falls_back_with_one_warning(caplog):
    with caplog.at_level(logging.INFO, logger="seedvr2"):
        paths = choose_paths("cpu", F16, fp16_accumulation=True)
    assert paths == TODAY
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["vae_fp16_accumulation: comfy_kitchen.fp16_conv3d needs a GPU; the VAE's "
                        "convolutions run as without it"]
    assert any("VAE paths on cpu: channels-first buffers, FrameGroupNorm then SiLU, torch "
               "conv3d" in r.message for r in caplog.records)
    with capable_gpu((12, 0), check_products=False):
        assert choose_paths("cpu", F16, fp16_accumulation=True, channels_last=True) == \
            VaePaths(channels_last=True, fused_norm=True, fp16_accumulation=True)
        assert choose_paths("cpu", torch.float32) == TODAY  # the kernels take half precision
    with capable_gpu((12, 0), torch_cuda=(12, 8), check_products=False):
        assert choose_paths("cpu", F16, fp16_accumulation=True) == TODAY  # kitchen's eager


def test_paths_need_comfy_kitchens_cuda_backend_loaded(caplog):
    """A CUDA 13 torch whose comfy-kitchen CUDA kernels failed to load (a missing runtime
    library) computes through kitchen's eager stand-in, which copies whole activations: the
    VAE runs today's paths, and says why."""
    from unittest import mock

    from seedvr2 import kernels

    pytest.importorskip("comfy_kitchen", reason="comfy-kitchen not installed")
    assert kernels.kitchen_cuda_missing()  # this machine: no CUDA
    missing = "libcudart.so.13: cannot open shared object file"
    with capable_gpu((12, 0), check_products=False), \
            mock.patch.object(kernels, "kitchen_cuda_missing", lambda: missing), \
            caplog.at_level(logging.WARNING, logger="seedvr2"):
        assert choose_paths("cpu", F16, fp16_accumulation=True) == TODAY
    assert [r.message for r in caplog.records] == [
        f"vae_fp16_accumulation: comfy-kitchen's CUDA backend did not load ({missing}); the "
        f"VAE's convolutions run as without it"]


def test_the_vae_on_every_path_stays_within_two_fp16_runs_of_today(tiny_vae):  # noqa: F811
    """Encode and decode of the tiny VAE in fp16 in temporal chunks (causal caches in int8 above
    a few KiB, in "host" memory) on channels-last buffers, the fused norm and fp16_conv3d, every
    kernel call checked: without the int8 tails within two fp16 runs' bound of today's; with
    them, plus the int8 roundings of the tails."""
    from seedvr2.memory import tiling

    vae = tiny_vae
    half = type(vae)(vae.config).half().eval()
    half.load_state_dict(vae.state_dict())
    video = load_case("video_9f")["inputs.video"][:, :, :, :16, :24].half()
    tiles = tiling.TileSettings()
    try:
        with torch.inference_mode():
            latent = tiling.encode(half, video, tiles, temporal_chunk=4)
            decoded = tiling.decode(half, latent, tiles, temporal_chunk=4)
            results = {}
            for name, paths in (("fused", VaePaths(True, True, True)),
                                ("int8", VaePaths(True, True, True, 4096, True))):
                half.set_conv_settings(cudnn_benchmark=False, paths=paths)
                with capable_gpu((12, 0), check_products=False) as log:
                    results[name] = (tiling.encode(half, video, tiles, temporal_chunk=4),
                                     tiling.decode(half, latent, tiles, temporal_chunk=4))
                assert log.calls["comfy_kitchen.group_norm_silu_pad3d"] > 0
                assert log.calls["comfy_kitchen.fp16_conv3d"] > 0
    finally:
        half.set_conv_settings(cudnn_benchmark=False)
    layers = sum(isinstance(m, torch.nn.Conv3d) for m in half.decoder.modules())
    bound = 2 * low_precision_bound(F16, layers)  # measured 1.4e-3 (encode), 1.2e-3 (decode)
    assert _rel_l2(results["fused"][0], latent) <= bound
    assert _rel_l2(results["fused"][1], decoded) <= bound
    # As conftest.low_precision_bound, with int8's relative rounding (half a step of absmax /
    # 127) once per conv reading a cached tail: measured 9.1e-3.
    cached = sum(isinstance(m, CausalConv3d) and m.tail_frames > 0
                 for m in half.decoder.modules())
    assert _rel_l2(results["int8"][1], decoded) <= bound + 2 * cached ** 0.5 / 254


def test_int8_tail_truncated_instead_of_rounded_fails_the_bound(monkeypatch):
    tail = _frames((1, 16, 2, 8, 8), F16)
    monkeypatch.setattr(torch.Tensor, "round_", lambda t: t)  # the cast then truncates
    back = PackedTail.pack(tail).unpack()
    step = tail.float().abs().max().item() / 127
    eps = torch.finfo(F16).eps
    allowed = step / 2 * (1 + 1e-6) + eps * tail.float().abs()
    excess = (back.float() - tail.float()).abs() - allowed
    assert excess.max().item() > step / 4
