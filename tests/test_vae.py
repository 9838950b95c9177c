"""Causal video VAE against the conformance goldens (reference run in float32 on CPU).

Data: the conformance kit (``tests/conformance`` or ``$SEEDVR2_CONFORMANCE``; README sections
2, 6, 10), checked once at session start by conftest.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache

import pytest
import torch
from safetensors.torch import load_file

from seedvr2.models import VAEConfig, build_vae
from seedvr2.models.vae import VideoAutoencoder
from seedvr2.models.vae_blocks import CausalCache

from conftest import conformance_dir, low_precision_bound, rounding_bound, sum_lengths

CASES = ("video_9f", "image_1f")
PIPELINE_SCALE = 0.9152


@lru_cache(maxsize=None)
def _tiny_files():
    root = conformance_dir() / "vae_tiny"
    return json.loads((root / "config.json").read_text()), load_file(root / "weights.safetensors")


def load_case(name: str) -> dict:
    return load_file(conformance_dir() / "vae_tiny" / "cases" / f"{name}.safetensors")


@pytest.fixture(scope="module")
def tiny_vae() -> VideoAutoencoder:
    config, weights = _tiny_files()
    model = build_vae(config["constructor_kwargs"]).eval()
    model.load_state_dict(weights, strict=True)
    return model


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected).abs().max().item()


@lru_cache(maxsize=None)
def _sums(part: str) -> tuple[int, int]:
    config, _ = _tiny_files()
    with torch.device("meta"):
        return sum_lengths(getattr(build_vae(config["constructor_kwargs"]), part))


def vae_bound(reference: torch.Tensor, part: str) -> float:
    """Float32 rounding bound (conftest.rounding_bound) for an output of the tiny VAE's
    ``part`` ("encoder": 31 convolutions, the longest summing 3x3x3x32 = 864 products;
    "decoder": 42): 7e-5 at the encoder's magnitude 1.8, 2.2e-4 at the decoder's 4.8. Another
    implementation (the goldens) or another summation order (chunks, threads) lands within;
    measured at most 2.1e-6 (README section 10) and 1.1e-6 (chunked, 1 or 2 threads)."""
    terms, layers = _sums(part)
    return rounding_bound(reference, terms=terms, layers=layers)


# -- structure --------------------------------------------------------------------------------

def test_tiny_weights_load_strictly():
    config, weights = _tiny_files()
    model = build_vae(config["constructor_kwargs"])
    result = model.load_state_dict(weights, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert shapes == config["state_dict_keys"]
    assert sum(p.numel() for p in model.parameters()) == config["num_parameters"]


@pytest.mark.parametrize("source", ["shipped", "manifest"])
def test_full_size_manifest_on_meta(source):
    manifest = json.loads((conformance_dir() / "manifests" / "vae_full.json").read_text())
    with torch.device("meta"):
        model = build_vae("vae" if source == "shipped" else manifest["config"])
    state = model.state_dict()
    assert {k: list(v.shape) for k, v in state.items()} == \
        {k: v["shape"] for k, v in manifest["keys"].items()}
    assert len(state) == manifest["num_state_dict_keys"] == 250
    assert all(v.is_meta for v in state.values()), "building on meta must allocate nothing"
    assert not list(model.buffers())
    assert sum(p.numel() for p in model.parameters()) == manifest["num_parameters"]


def test_quant_convs_exist_only_when_configured():
    config, _ = _tiny_files()
    kwargs = dict(config["constructor_kwargs"], use_quant_conv=True, use_post_quant_conv=True)
    with torch.device("meta"):
        plain = build_vae(config["constructor_kwargs"])
        model = build_vae(kwargs)
    extra = {k: tuple(v.shape) for k, v in model.state_dict().items()
             if k not in plain.state_dict()}
    assert extra == {"quant_conv.weight": (32, 32, 1, 1, 1), "quant_conv.bias": (32,),
                     "post_quant_conv.weight": (16, 16, 1, 1, 1), "post_quant_conv.bias": (16,)}


def test_quant_convs_are_applied_on_the_moments_and_the_latent():
    config, weights = _tiny_files()
    model = build_vae(dict(config["constructor_kwargs"], use_quant_conv=True,
                           use_post_quant_conv=True)).eval()
    swap = torch.eye(32).roll(16, dims=0)  # output = (logvar, mean): swaps the halves
    extra = {"quant_conv.weight": swap.view(32, 32, 1, 1, 1), "quant_conv.bias": torch.zeros(32),
             "post_quant_conv.weight": 2 * torch.eye(16).view(16, 16, 1, 1, 1),
             "post_quant_conv.bias": torch.zeros(16)}
    model.load_state_dict({**weights, **extra}, strict=True)
    case = load_case("image_1f")
    with torch.no_grad():
        mean, logvar = model.encode_posterior(case["inputs.video"])
        decoded = model.decode(case["outputs.posterior_mean"] / 2)
    assert max_abs(mean, case["outputs.posterior_logvar"]) < vae_bound(case["outputs.posterior_logvar"], "encoder")
    assert max_abs(logvar, case["outputs.posterior_mean"]) < vae_bound(case["outputs.posterior_mean"], "encoder")
    assert max_abs(decoded, case["outputs.decoded_from_mean"]) < vae_bound(case["outputs.decoded_from_mean"], "decoder")


# -- numerics against the goldens -------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_golden_case(tiny_vae, name):
    case = load_case(name)
    video = case["inputs.video"]
    with torch.no_grad():
        mean, logvar = tiny_vae.encode_posterior(video)
        encoded = tiny_vae.encode(video)
        decoded = tiny_vae.decode(case["outputs.posterior_mean"])

    assert mean.shape == logvar.shape == case["outputs.posterior_mean"].shape
    assert max_abs(mean, case["outputs.posterior_mean"]) < vae_bound(case["outputs.posterior_mean"], "encoder")
    assert max_abs(logvar, case["outputs.posterior_logvar"]) < vae_bound(case["outputs.posterior_logvar"], "encoder")
    assert torch.equal(encoded, mean)
    assert decoded.shape == video.shape  # 5-D even for a single frame
    assert max_abs(decoded, case["outputs.decoded_from_mean"]) < vae_bound(case["outputs.decoded_from_mean"], "decoder")
    # The documented pipeline convention: scaled, channels-last per sample.
    latent = (encoded * PIPELINE_SCALE).permute(0, 2, 3, 4, 1)
    assert max_abs(latent, case["outputs.latent_pipeline"]) < vae_bound(case["outputs.latent_pipeline"], "encoder")


@pytest.mark.parametrize("name", CASES)
def test_posterior_sample(name):
    case = load_case(name)
    mean, logvar = case["outputs.posterior_mean"], case["outputs.posterior_logvar"]
    sample = VideoAutoencoder.sample_posterior(mean, logvar, noise=case["aux.eps"])
    # mean + exp(logvar / 2) * eps: three roundings per element, no sums (exp may differ by an
    # ulp between vector paths of different CPUs).
    elementwise = dict(terms=1, layers=3)
    assert max_abs(sample, case["aux.posterior_sample_with_eps"]) < \
        rounding_bound(case["aux.posterior_sample_with_eps"], **elementwise)

    drawn = VideoAutoencoder.sample_posterior(mean, logvar, torch.Generator().manual_seed(7))
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(7))
    expected = mean + torch.exp(logvar / 2) * eps
    assert max_abs(drawn, expected) < rounding_bound(expected, **elementwise)


def test_logvar_is_clamped(tiny_vae):
    model = copy.deepcopy(tiny_vae)
    with torch.no_grad():
        model.encoder.conv_out.bias[16:] += 100.0  # push logvar far above the clamp
        _, logvar = model.encode_posterior(load_case("image_1f")["inputs.video"])
    assert logvar.max().item() == 20.0


def test_autograd_path_matches_and_backpropagates(tiny_vae):
    # With autograd recording, the in-place fast paths are off; same maths, and it trains.
    model = copy.deepcopy(tiny_vae)
    case = load_case("image_1f")
    video = case["inputs.video"].clone().requires_grad_(True)
    mean = model.encode(video)
    decoded = model.decode(case["outputs.posterior_mean"])
    assert max_abs(mean.detach(), case["outputs.posterior_mean"]) < vae_bound(case["outputs.posterior_mean"], "encoder")
    assert max_abs(decoded.detach(), case["outputs.decoded_from_mean"]) < vae_bound(case["outputs.decoded_from_mean"], "decoder")
    (mean.square().mean() + decoded.square().mean()).backward()
    assert video.grad is not None and torch.isfinite(video.grad).all()
    for name in ("encoder.conv_in.weight", "encoder.mid_block.resnets.0.norm1.weight",
                 "decoder.up_blocks.0.upsamplers.0.upscale_conv.weight", "decoder.conv_out.bias"):
        grad = model.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_channels_last_input_is_accepted(tiny_vae):
    case = load_case("image_1f")
    video = case["inputs.video"].to(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        mean = tiny_vae.encode(video)
    assert max_abs(mean, case["outputs.posterior_mean"]) < vae_bound(case["outputs.posterior_mean"], "encoder")


# -- causality / temporal chunking ------------------------------------------------------------

@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_chunked_causal_state_matches_single_pass(tiny_vae, torch_threads):
    # A spatial crop keeps this cheap; all 9 frames are needed for two encoder chunks.
    video = load_case("video_9f")["inputs.video"][:, :, :, :16, :24]
    latent = load_case("video_9f")["outputs.posterior_mean"]
    with torch.no_grad():
        full = tiny_vae.encoder(video)
        cache = CausalCache()
        first = tiny_vae.encoder(video[:, :, :5], cache)
        chunked = torch.cat([first, tiny_vae.encoder(video[:, :, 5:], cache)], dim=2)
        # Causal: the first 5 frames alone give the first 2 latent frames of the whole clip.
        # The same sums over other tensor shapes: the kernels may block (and so round) them
        # differently (1.1e-6 measured on AMD EPYC, 1 or 2 threads; 0 on others).
        assert max_abs(first, full[:, :, :2]) < vae_bound(full, "encoder")
        assert max_abs(chunked, full) < vae_bound(full, "encoder")

        full = tiny_vae.decoder(latent)
        cache = CausalCache()
        chunked = torch.cat([tiny_vae.decoder(latent[:, :, :2], cache),
                             tiny_vae.decoder(latent[:, :, 2:], cache)], dim=2)
        assert chunked.shape == full.shape
        # Convolutions over fewer frames sum in another order (measured 4.8e-6 on AVX-512).
        assert max_abs(chunked, full) < vae_bound(full, "decoder")


def test_cache_hooks_default_to_the_plain_per_frame_maths(tiny_vae):
    # A CausalCache without temporal state runs every call as a whole clip; its frame-wide
    # hooks (statistics, attention tokens) default to the tensor at hand, i.e. the plain model.
    video = load_case("video_9f")["inputs.video"][:, :, :5, :16, :24]
    with torch.no_grad():
        plain = tiny_vae.encoder(video)
        hooked = tiny_vae.encoder(video, CausalCache(temporal=False))
        again = tiny_vae.encoder(video, CausalCache(temporal=False))
    assert torch.equal(hooked, plain) and torch.equal(again, plain)


@pytest.mark.parametrize("rows", [16, 48], ids=["row_blocks", "frame_per_call"])
def test_attention_within_a_small_score_budget_matches_one_call(tiny_vae, monkeypatch, rows):
    # Frames are attended in groups within the budget; when one frame's score matrix
    # exceeds it, its queries in row blocks (here 48 tokens per frame: 16-row blocks).
    from seedvr2.models import vae_blocks

    latent = load_case("video_9f")["outputs.posterior_mean"]  # 3 frames of 6 x 8 latents
    with torch.no_grad():
        full = tiny_vae.decode(latent)
        monkeypatch.setattr(vae_blocks, "ATTENTION_SCORE_BUDGET", rows * 48)
        blocked = tiny_vae.decode(latent)
    # Softmax sums over the same keys, in row blocks: another summation order.
    assert max_abs(blocked, full) < vae_bound(full, "decoder")


# -- argument checks --------------------------------------------------------------------------

@pytest.mark.parametrize("shape, match", [
    ((1, 3, 40, 56), r"video must be 5-D \(B, C, T, H, W\).*unsqueeze\(2\)"),
    ((1, 4, 1, 40, 56), r"video must have 3 channels.*got 4"),
    ((1, 3, 4, 40, 56), r"video frame count T must be 4n\+1.*got T=4"),
    ((1, 3, 1, 44, 56), r"video height and width must be positive multiples of 8.*H=44"),
    ((1, 3, 1, 40, 50), r"multiples of 8.*W=50"),
])
def test_encode_rejects_bad_video(tiny_vae, shape, match):
    with pytest.raises(ValueError, match=match):
        tiny_vae.encode(torch.zeros(shape))


@pytest.mark.parametrize("shape, match", [
    ((1, 16, 5, 7), r"latent must be 5-D \(B, C, t, h, w\)"),
    ((1, 8, 1, 5, 7), r"latent must have 16 channels.*got 8"),
    ((1, 1, 5, 7, 16), r"latent must have 16 channels.*channels-last"),
])
def test_decode_rejects_bad_latent(tiny_vae, shape, match):
    with pytest.raises(ValueError, match=match):
        tiny_vae.decode(torch.zeros(shape))


def test_public_checks_validate_without_running(tiny_vae):
    # check_video / check_latent are the validation encode / decode use (tiled runs call them).
    tiny_vae.check_video(torch.zeros(2, 3, 9, 16, 24))
    tiny_vae.check_latent(torch.zeros(2, 16, 3, 2, 3))
    with pytest.raises(TypeError, match=r"video must be a torch.Tensor, got list"):
        tiny_vae.check_video([0.0])
    with pytest.raises(ValueError, match=r"video frame count T must be 4n\+1.*got T=2"):
        tiny_vae.check_video(torch.zeros(1, 3, 2, 16, 16))
    with pytest.raises(TypeError, match=r"latent must be a torch.Tensor, got NoneType"):
        tiny_vae.check_latent(None)
    with pytest.raises(ValueError, match=r"latent must have non-empty t, h, w"):
        tiny_vae.check_latent(torch.zeros(1, 16, 0, 2, 2))


# -- reduced precision ------------------------------------------------------------------------

def vae_low_precision_bound(dtype: torch.dtype, part: str) -> float:
    """conftest.low_precision_bound through the part's layers. Encoder (31 layers): bf16
    4.3e-2, fp16 5.4e-3; decoder (42): 5.1e-2, 6.3e-3. Measured: bf16 <= 2.1e-2, fp16 <=
    2.5e-3; fp16 is the sharper of the two checks."""
    return low_precision_bound(dtype, _sums(part)[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_stays_close_to_float32(tiny_vae, dtype):
    model = copy.deepcopy(tiny_vae).to(dtype)
    image = load_case("image_1f")
    # A small crop of the video covers the temporal down/up-sampling paths cheaply (CPU
    # reduced-precision conv3d is slow).
    clip = load_case("video_9f")["inputs.video"][:, :, :5, :16, :24]
    with torch.no_grad():
        clip_mean, clip_logvar = tiny_vae.encode_posterior(clip)
        clip_decoded = tiny_vae.decode(clip_mean)
        checks = [
            ("encoder", model.encode_posterior(image["inputs.video"]),
             (image["outputs.posterior_mean"], image["outputs.posterior_logvar"])),
            ("decoder", (model.decode(image["outputs.posterior_mean"]),),
             (image["outputs.decoded_from_mean"],)),
            ("encoder", model.encode_posterior(clip), (clip_mean, clip_logvar)),
            ("decoder", (model.decode(clip_mean),), (clip_decoded,)),
        ]
    for part, outputs, references in checks:
        bound = vae_low_precision_bound(dtype, part)
        for out, ref in zip(outputs, references):
            assert out.dtype == dtype and torch.isfinite(out).all()
            assert rel_l2(out, ref) < bound, f"{dtype} rel-L2 {rel_l2(out, ref):.3g} >= {bound}"


def test_config_dataclass_is_accepted_directly():
    with torch.device("meta"):
        model = VideoAutoencoder(VAEConfig(block_out_channels=(16, 24, 32, 32), norm_num_groups=8))
    assert model.encoder.conv_out.weight.shape == (32, 32, 3, 3, 3)
