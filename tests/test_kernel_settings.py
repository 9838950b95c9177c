"""Kernel choices a GPU run depends on, checked on the CPU: ``attention_backend=auto`` picks
FlashAttention-3 on Hopper when it is installed (patched device capability, a stand-in
package on sys.path), and the VAE options ``vae_channels_last`` / ``vae_cudnn_benchmark``
reach the VAE's convolutions (memory format of their inputs, the cuDNN flag while they run
and restored afterwards)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import seedvr2
from seedvr2.models import attention, build_dit, build_vae
from seedvr2.models.attention import WindowAttention, auto_backend
from seedvr2.models.vae_paths import VaePaths
from seedvr2.options import resolve_options

from conftest import constructor_kwargs, network_bound


def _query(device="cuda:0", dtype=torch.bfloat16):
    """What auto_backend reads of a query tensor, without needing a GPU."""
    device = torch.device(device)
    return types.SimpleNamespace(is_cuda=device.type == "cuda", dtype=dtype, device=device)


@pytest.fixture
def fa3_installed(tmp_path, monkeypatch):
    (tmp_path / f"{attention.FLASH_ATTN_3_MODULE}.py").write_text(
        "def flash_attn_func(q, k, v):\n    raise AssertionError('not called on the CPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def _capability(monkeypatch, major, minor=0):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))


def test_auto_picks_flash_attn_3_on_hopper_when_installed(fa3_installed, monkeypatch):
    _capability(monkeypatch, 9, 0)
    assert auto_backend(_query()) == "flash_attn_3"
    assert auto_backend(_query(dtype=torch.float16)) == "flash_attn_3"
    # FA3 is Hopper-only and half precision only; the CPU never leaves SDPA.
    assert auto_backend(_query(dtype=torch.float32)) == "sdpa"
    assert auto_backend(_query("cpu")) == "sdpa"
    for other in ((8, 0), (8, 9), (10, 0), (12, 0)):
        _capability(monkeypatch, *other)
        assert auto_backend(_query()) == "sdpa", other


def test_auto_falls_back_to_sdpa_without_the_package(monkeypatch):
    _capability(monkeypatch, 9, 0)
    monkeypatch.setattr(attention, "FLASH_ATTN_3_MODULE", "seedvr2_no_such_fa3_module")
    assert auto_backend(_query()) == "sdpa"


def test_a_layer_decides_auto_once_per_device_and_dtype(fa3_installed, monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "auto_backend",
                        lambda q: calls.append(q.dtype) or "flash_attn_3")
    layer = WindowAttention(8, 2, 4, 1e-6, True, torch.nn.Identity())
    layer.backend = "auto"
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float16, torch.float16):
        assert layer.kernel_for(_query(dtype=dtype)) == "flash_attn_3"
    assert calls == [torch.bfloat16, torch.float16]
    layer.backend = "sdpa"  # an explicit choice is never second-guessed
    assert layer.kernel_for(_query()) == "sdpa"


def test_auto_runs_sdpa_on_the_cpu(conformance):
    model = build_dit(constructor_kwargs(conformance / "dit3b_tiny"))
    model.set_attention_backend("auto")
    q, k, v = torch.randn(3, 2, 7, 4, 8).unbind(0)
    torch.testing.assert_close(attention.attend(q, k, v, "auto"), attention.attend(q, k, v),
                               atol=0, rtol=0)
    assert model.blocks[0].attn.kernel_for(q) == "sdpa"


# -- the VAE's convolution settings ---------------------------------------------------------

@pytest.fixture
def conv_calls(monkeypatch):
    """Every F.conv3d call: (input is channels-last, cudnn.benchmark while it ran)."""
    calls = []
    conv3d = F.conv3d

    def recording(x, *args, **kwargs):
        calls.append((x.is_contiguous(memory_format=torch.channels_last_3d) and x.shape[1] > 1,
                      torch.backends.cudnn.benchmark))
        return conv3d(x, *args, **kwargs)

    monkeypatch.setattr(F, "conv3d", recording)
    return calls


@pytest.fixture(scope="module")
def tiny_vae(conformance):
    torch.manual_seed(0)
    vae = build_vae(constructor_kwargs(conformance / "vae_tiny")).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return vae


def test_channels_last_reaches_every_convolution_and_keeps_the_result(tiny_vae, conv_calls):
    video = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    with torch.no_grad():
        expected = tiny_vae.decode(tiny_vae.encode(video))
        assert conv_calls and not any(cl for cl, _ in conv_calls)
        conv_calls.clear()
        tiny_vae.set_conv_settings(cudnn_benchmark=False, paths=VaePaths(channels_last=True))
        try:
            out = tiny_vae.decode(tiny_vae.encode(video))
        finally:
            tiny_vae.set_conv_settings(cudnn_benchmark=False)
    assert conv_calls and all(cl for cl, _ in conv_calls)
    # Same sums in another memory order: they differ by rounding only.
    torch.testing.assert_close(out, expected, atol=network_bound(tiny_vae, expected), rtol=0)
    assert out.is_contiguous()  # channels-first again for everything after the convolutions


def test_cudnn_benchmark_is_set_while_the_vae_runs_and_restored(tiny_vae, conv_calls,
                                                                monkeypatch):
    latent = torch.randn(1, 16, 2, 4, 4)
    assert torch.backends.cudnn.benchmark is False
    tiny_vae.set_conv_settings(cudnn_benchmark=True)
    try:
        with torch.no_grad():
            tiny_vae.decode(latent)
        assert conv_calls and all(benchmark for _, benchmark in conv_calls)
        assert torch.backends.cudnn.benchmark is False
        recording = F.conv3d

        def failing(*args, **kwargs):  # a convolution that fails mid-decode
            recording(*args, **kwargs)
            raise RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR")

        monkeypatch.setattr(F, "conv3d", failing)
        with pytest.raises(RuntimeError, match="CUDNN_STATUS"), torch.no_grad():
            tiny_vae.decode(latent)
        assert conv_calls[-1][1] is True and torch.backends.cudnn.benchmark is False
        monkeypatch.setattr(F, "conv3d", recording)
    finally:
        tiny_vae.set_conv_settings(cudnn_benchmark=False)
    conv_calls.clear()
    with torch.no_grad():
        tiny_vae.decode(latent)
    assert conv_calls and not any(benchmark for _, benchmark in conv_calls)


@pytest.mark.parametrize("exact", [False, True])
def test_the_options_reach_the_vae_of_a_job(tiny_options, conv_calls, exact):
    """Through seedvr2.upscale: tiled encode and decode (the tiling entry points; independent
    or exact tiles) run every convolution channels-last with cuDNN benchmarking on, and the
    flag is off again after."""
    assert {"vae_cudnn_benchmark", "vae_channels_last"} <= set(resolve_options().values)
    clip = torch.rand(5, 24, 32, 3)
    seedvr2.upscale(clip, **tiny_options, resolution=96, batch_size=5,
                    text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"),
                    vae_encode_tiled=True, vae_decode_tiled=True, vae_encode_tile_size=64,
                    vae_decode_tile_size=64, vae_encode_tile_overlap=16, vae_decode_tile_overlap=16,
                    vae_tiling_exact=exact, vae_cudnn_benchmark=True, vae_channels_last=True)
    assert conv_calls and all(cl and benchmark for cl, benchmark in conv_calls)
    assert torch.backends.cudnn.benchmark is False


def test_a_given_dit_module_gets_the_jobs_attention_backend(conformance, tiny_options):
    from seedvr2.loading import load_dit
    from seedvr2.pipeline.model_loading import load_models

    dit = load_dit(conformance / "dit3b_tiny" / "weights.safetensors")
    assert {b.attn.backend for b in dit.blocks} == {"sdpa"}
    options = {k: v for k, v in tiny_options.items() if k not in ("dit", "vae", "model_dir")}
    models = load_models(dit, tiny_options["vae"], model_dir=tiny_options["model_dir"],
                         opts=resolve_options(**options, attention_backend="auto",
                                              text_embeddings=str(tiny_options["model_dir"]
                                                                  / "text_64.safetensors")))
    assert {b.attn.backend for b in models.dit.blocks} == {"auto"}
