"""Convolutions and norms over SPLIT_ELEMENTS run in pieces (the 1080p decoder's 3.7e9-element
convs), with the results of one piece: checked on the CPU by lowering the threshold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seedvr2.models import vae_blocks
from seedvr2.models.vae_blocks import CausalConv3d, ConvSpec, FrameGroupNorm, conv3d_in_bands

from conftest import network_bound, rounding_bound
from test_vae import load_case, tiny_vae  # noqa: F401  (fixture)


class _CallLog:
    """Records the input and output element counts of every convolution the VAE's layers
    make (``vae_blocks.conv3d``: F.conv3d, or the CPU's 1x1x1 matrix product)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = vae_blocks.conv3d

        def conv3d(x, *args, **kwargs):
            y = real(x, *args, **kwargs)
            self.calls.append((x.numel(), y.numel()))
            self.shapes.append((x.shape, y.shape))
            return y
        self.shapes = []
        monkeypatch.setattr(vae_blocks, "conv3d", conv3d)

    def within(self, limit: int) -> bool:
        """Every call is at most ``limit`` elements in and out, or is a band of one output row
        (the smallest band there is; at the top or bottom edge it computes one more row, which
        its own zero padding adds and which is dropped)."""
        return all(max(x.numel(), y.numel()) <= limit or y[3] <= 2 for x, y in self.shapes)


@pytest.mark.parametrize("kernel, stride, padding", [
    ((3, 3, 3), (1, 1, 1), (0, 1, 1)),  # the residual blocks' convs
    ((3, 3, 3), (2, 2, 2), (0, 0, 0)),  # the temporal down-sampler (after its explicit pad)
    ((1, 3, 3), (1, 2, 2), (0, 0, 0)),
    ((1, 1, 1), (1, 1, 1), (0, 0, 0)),  # shortcut / upscale_conv
])
def test_conv_bands_equal_one_call(kernel, stride, padding, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(1, 4, 5, 23, 9, dtype=torch.float64)
    weight = torch.randn(6, 4, *kernel, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64)
    whole = F.conv3d(x, weight, bias, stride, padding)
    log = _CallLog(monkeypatch)
    limit = 600  # a few output rows per band: many bands, halos at both ends
    banded = conv3d_in_bands(x, ConvSpec(weight, bias, stride, padding), limit=limit)
    assert len(log.calls) > 3 and log.within(limit)
    # Same products summed in the same order per output element: float64 bands are expected to
    # match exactly; allow float64 rounding of one 4*27-term sum (conftest.rounding_bound) in
    # case the backend blocks the reduction by shape.
    assert banded.shape == whole.shape
    torch.testing.assert_close(banded, whole, rtol=0, atol=rounding_bound(whole, terms=4 * 27))


def test_causal_conv_splits_above_the_threshold(monkeypatch):
    torch.manual_seed(1)
    conv = CausalConv3d(3, 5, 3, padding=1).double()
    x = torch.randn(1, 3, 5, 16, 12, dtype=torch.float64)
    whole = conv(x)
    log = _CallLog(monkeypatch)
    monkeypatch.setattr(vae_blocks, "SPLIT_ELEMENTS", 2000)
    banded = conv(x)
    assert len(log.calls) > 1 and log.within(2000)
    # As above: one 3*27-term float64 sum.
    torch.testing.assert_close(banded, whole, rtol=0, atol=rounding_bound(whole, terms=3 * 27))


def test_upcasting_norm_never_upcasts_all_of_its_input(monkeypatch):
    """A bf16 input over the threshold is upcast a channel group at a time: same bits out."""
    torch.manual_seed(2)
    norm = FrameGroupNorm(4, 16, eps=1e-6)
    norm.weight.data.normal_()
    norm.bias.data.normal_()
    x = torch.randn(1, 16, 3, 8, 8).to(torch.bfloat16) * 3 + 1
    norm.requires_grad_(False)  # inference, where the in-place path runs
    whole = norm(x)
    biggest = []
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        y = real_to(self, *args, **kwargs)
        if y.dtype == torch.float32 and self.dtype == torch.bfloat16:
            biggest.append(self.numel())
        return y
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    monkeypatch.setattr(vae_blocks, "SPLIT_ELEMENTS", x.numel() // 4)
    split = norm(x)
    assert biggest and max(biggest) <= x.numel() // 4
    assert torch.equal(split, whole)


def test_vae_decode_and_encode_with_a_tiny_threshold_match(tiny_vae, monkeypatch):  # noqa: F811
    """The whole tiny VAE with every conv and norm over 4096 elements in pieces: float32
    sums of up to 27·C_in terms may be reassociated by the backend for a different shape,
    so the bound is conftest.network_bound of the encoder and the decoder; measured exact."""
    case = load_case("video_9f")
    video = case["inputs.video"]
    with torch.inference_mode():
        latent = tiny_vae.encode(video)
        decoded = tiny_vae.decode(latent)
        log = _CallLog(monkeypatch)
        monkeypatch.setattr(vae_blocks, "SPLIT_ELEMENTS", 4096)
        latent_split = tiny_vae.encode(video)
        decoded_split = tiny_vae.decode(latent)
    assert log.within(4096) and len(log.calls) > 2 * sum(
        isinstance(m, torch.nn.Conv3d) for m in tiny_vae.modules())
    torch.testing.assert_close(latent_split, latent, rtol=0,
                               atol=network_bound(tiny_vae.encoder, latent))
    torch.testing.assert_close(decoded_split, decoded, rtol=0,
                               atol=network_bound(tiny_vae.decoder, decoded))


def _upsampler_and_block(temporal: bool):
    torch.manual_seed(3)
    up = vae_blocks.Upsample3D(6, temporal).double()
    block = vae_blocks.ResnetBlock3D(6, 4, groups=2).double()
    for norm in (block.norm1, block.norm2):
        norm.weight.data.normal_()
        norm.bias.data.normal_()
    return up.requires_grad_(False), block.requires_grad_(False)


@pytest.mark.parametrize("temporal", [True, False])
def test_upsampler_bands_equal_one_pass(temporal, monkeypatch):
    """The up-sampler makes each band's padded input from the input rows under it: the same
    sums as one pass over the whole depth-to-space output, across two cached chunks too."""
    up, _ = _upsampler_and_block(temporal)
    x = torch.randn(1, 6, 3, 7, 5, dtype=torch.float64)

    def chunked():
        cache = vae_blocks.CausalCache()
        return torch.cat([up(x[:, :, :2], cache), up(x[:, :, 2:], cache)], dim=2)
    whole, whole_chunked = up(x), chunked()
    log = _CallLog(monkeypatch)
    limit = 900  # the upscale output (6*8*3*7*5 = 5040) and padded input (>= 2240) are banded
    monkeypatch.setattr(vae_blocks, "SPLIT_ELEMENTS", limit)
    banded, banded_chunked = up(x), chunked()
    assert len(log.calls) > 4 and log.within(limit)
    bound = rounding_bound(whole, terms=6 * 27, layers=2)  # upscale_conv, then the 3x3x3 conv
    torch.testing.assert_close(banded, whole, rtol=0, atol=bound)
    torch.testing.assert_close(banded_chunked, whole_chunked, rtol=0, atol=bound)
    torch.testing.assert_close(whole_chunked, whole, rtol=0, atol=bound)


@pytest.mark.parametrize("limit", [1 << 30, 700])
def test_upsampler_into_a_block_with_a_shortcut_equals_two_calls(limit, monkeypatch):
    """run_layers hands the up-sampler's output to the next block inside that block's padded
    buffer, normalised in place after the shortcut read it: the bits of calling the two."""
    up, block = _upsampler_and_block(temporal=True)
    x = torch.randn(1, 6, 3, 6, 5, dtype=torch.float64)
    monkeypatch.setattr(vae_blocks, "SPLIT_ELEMENTS", limit)
    apart = block(up(x))
    owned = []
    real = vae_blocks.ResnetBlock3D.forward_owned
    monkeypatch.setattr(vae_blocks.ResnetBlock3D, "forward_owned",
                        lambda self, *a: owned.append(1) or real(self, *a))
    together = vae_blocks.run_layers([up, block], x)
    assert owned and torch.equal(together, apart)
    # Two chunks through one cache each: the owned path keeps the causal tails right.
    caches = vae_blocks.CausalCache(), vae_blocks.CausalCache()
    apart = [block(up(x[:, :, a:b], caches[0]), caches[0]) for a, b in ((0, 1), (1, 3))]
    together = [vae_blocks.run_layers([up, block], x[:, :, a:b], caches[1])
                for a, b in ((0, 1), (1, 3))]
    assert all(torch.equal(t, a) for t, a in zip(together, apart))


def test_with_autograd_the_block_gets_its_input_as_is(monkeypatch):
    """The in-place hand-over would break the autograd graph: with parameters that train, the
    plain calls run."""
    up, block = _upsampler_and_block(temporal=False)
    block.requires_grad_(True)
    x = torch.randn(1, 6, 1, 4, 4, dtype=torch.float64)
    monkeypatch.setattr(vae_blocks.ResnetBlock3D, "forward_owned", None)  # must not be called
    vae_blocks.run_layers([up, block], x).sum().backward()
    assert block.conv1.weight.grad is not None


@pytest.mark.parametrize("limit", [1 << 30, 4096])
def test_channels_last_buffers_give_todays_result(tiny_vae, limit, monkeypatch):  # noqa: F811
    """vae_channels_last: the padded buffers are NDHWC and the bands views of them (issue #36);
    the same sums, reassociated by the backend's channels-last kernels: within
    conftest.network_bound of today's, in whole calls and in bands, across causal chunks."""
    from seedvr2.memory import tiling
    from seedvr2.models.vae_paths import VaePaths

    video = load_case("video_9f")["inputs.video"]
    tiles = tiling.TileSettings()
    monkeypatch.setattr(vae_blocks, "SPLIT_ELEMENTS", limit)
    layouts = []
    real_buffer = CausalConv3d.input_buffer

    def recording_buffer(self, *args):
        buf, body = real_buffer(self, *args)
        layouts.append(buf.is_contiguous(memory_format=torch.channels_last_3d))
        return buf, body
    try:
        with torch.inference_mode():
            latent = tiling.encode(tiny_vae, video, tiles, temporal_chunk=4)
            decoded = tiling.decode(tiny_vae, latent, tiles, temporal_chunk=4)
            tiny_vae.set_conv_settings(cudnn_benchmark=False, paths=VaePaths(channels_last=True))
            monkeypatch.setattr(CausalConv3d, "input_buffer", recording_buffer)
            latent_cl = tiling.encode(tiny_vae, video, tiles, temporal_chunk=4)
            decoded_cl = tiling.decode(tiny_vae, latent, tiles, temporal_chunk=4)
    finally:
        tiny_vae.set_conv_settings(cudnn_benchmark=False)
    assert layouts and all(layouts)  # every padded buffer
    torch.testing.assert_close(latent_cl, latent, rtol=0,
                               atol=network_bound(tiny_vae.encoder, latent))
    torch.testing.assert_close(decoded_cl, decoded, rtol=0,
                               atol=network_bound(tiny_vae.decoder, decoded))
