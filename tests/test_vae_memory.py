"""The released VAE's memory at real size without a GPU: encode and decode of 1080p x 5 frames
in fp16 traced on fake tensors (no data), every live tensor counted (issue #35, part 3)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from seedvr2.models import vae_blocks
from seedvr2.models.config import vae_config
from seedvr2.models.vae import VideoAutoencoder

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from memory_trace import LiveBytes  # noqa: E402

GIB = 1 << 30
B, T, H, W = 1, 5, 1088, 1920  # 1080p padded to the multiple of 16, one 5-frame batch



@pytest.fixture(scope="module")
def fake_vae():
    """The released VAE in fp16 on fake tensors (no memory), and the mode that made it."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        torch.set_default_dtype(torch.float16)
        try:
            vae = VideoAutoencoder(vae_config("vae")).requires_grad_(False)
        finally:
            torch.set_default_dtype(torch.float32)
    return mode, vae


def _traced_peak(fake_vae, decode: bool) -> int:
    fake_mode, vae = fake_vae
    with fake_mode:
        x = (torch.empty(B, 16, (T - 1) // 4 + 1, H // 8, W // 8, dtype=torch.float16) if decode
             else torch.empty(B, 3, T, H, W, dtype=torch.float16))
        mode = LiveBytes("cpu")  # (fake tensors on the CPU)
        with torch.inference_mode(), mode:
            (vae.decode if decode else vae.encode)(x)
    return mode.peak


def _band_temporaries() -> int:
    """One band's input and output (each at most a quarter of SPLIT_ELEMENTS, fp16)."""
    return 2 * (vae_blocks.SPLIT_ELEMENTS // 4) * 2


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "encode"])
def test_real_size_peak_is_what_the_layout_holds(fake_vae, decode):
    """Decode: at the first full-resolution block's conv1, its padded input (256 channels,
    T + 2 frames), the shortcut's and conv1's outputs (128 channels, T frames) and one band;
    before (#35) 19.4 GiB: the input and its padded copy, the up-sampler's 4x output, two
    float32 norm pieces. Encode: at a full-resolution block's conv2, the block's input, conv1's
    output, conv2's padded input and output (128 channels) and one band; before 16.9 GiB."""
    frame = H * W * 2  # bytes of one fp16 plane
    if decode:
        held = 256 * (T + 2) * frame + 2 * 128 * T * frame
    else:
        held = 3 * 128 * T * frame + 128 * (T + 2) * frame
    peak = _traced_peak(fake_vae, decode)
    assert held <= peak <= held + _band_temporaries(), (peak / GIB, held / GIB)


@pytest.mark.parametrize("value, paths", [
    ("off", {}), ("on", {"int8_cache_bytes": 64 << 20}),
    ("host", {"int8_cache_bytes": 64 << 20, "cache_offload": True})])
def test_the_int8_cache_option_reaches_the_vae(tiny_options, value, paths):
    """vae_int8_cache: the loaded VAE's causal caches keep tails from 64 MiB on in int8, on its
    device or in host memory (issue #36); the job's other VAE paths are today's on the CPU."""
    from seedvr2.models.vae_paths import VaePaths
    from seedvr2.options import resolve_options
    from seedvr2.pipeline.model_loading import load_models

    opts = resolve_options(device="cpu", dtype="fp32", vae_int8_cache=value)
    models = load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                         model_dir=tiny_options["model_dir"])
    assert models.vae.paths == VaePaths(**paths)
    assert models.vae.new_cache().paths == models.vae.paths
