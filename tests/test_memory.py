"""Memory manager: BlockSwap schedule and mechanics, model cache, compile settings."""

from __future__ import annotations

import warnings

import pytest
import torch

import seedvr2
from seedvr2.api import load_models
from seedvr2.loading import load_dit, load_vae
from seedvr2.memory import MODEL_CACHE
from seedvr2.memory.blockswap import BlockSwap, SwapRuntime, SwapSchedule
from seedvr2.memory.compile import CompileSettings, apply_compile
from seedvr2.options import OptionError, resolve_options

from conftest import dit_bound, load_case, rounding_bound, sum_lengths


def test_schedule_keeps_at_most_current_plus_prefetch_resident():
    schedule = SwapSchedule(num_units=8, swapped=frozenset(range(6)), prefetch=1)
    for i in range(8):
        schedule.before(i)
        assert len(schedule.resident) <= 2
        schedule.after(i)
    assert schedule.max_resident == 2
    assert schedule.log[:4] == [("load", 0), ("load", 1), ("release", 0), ("load", 2)]
    assert schedule.resident == set()


def _forward(model, case):
    with torch.no_grad():
        return model(case["inputs.vid"], case["inputs.txt"], case["inputs.vid_shape"],
                     case["inputs.txt_shape"], case["inputs.timestep"])


def test_blockswap_mechanics_on_cpu_change_nothing(conformance):
    """Forced on the CPU, the real hook path runs: same output, weights back on the host."""
    folder = conformance / "dit3b_tiny"
    case = load_case(folder, "video_ragged")
    expected = _forward(load_dit(folder / "weights.safetensors"), case)
    model = load_dit(folder / "weights.safetensors")
    swap = BlockSwap(model, blocks_to_swap=3, swap_io=True, device=torch.device("cpu"),
                     offload_device=torch.device("cpu"), runtime=SwapRuntime(force=True))
    out = _forward(model, case)
    assert torch.equal(out, expected)
    assert swap.schedule.max_resident <= 2  # the running unit and the one being prefetched
    assert swap.schedule.resident == set()
    assert swap.copies == {}
    loads = [u for e, u in swap.schedule.log if e == "load"]
    assert loads == sorted(swap.schedule.swapped)  # each swapped unit loaded once, in order
    swap.leave()
    assert torch.equal(_forward(model, case), expected)


def test_blockswap_clamps_and_is_inactive_without_cuda(conformance, caplog):
    model = load_dit(conformance / "dit7b_tiny" / "weights.safetensors")
    with caplog.at_level("INFO", logger="seedvr2"):
        swap = BlockSwap(model, 99, False, torch.device("cpu"), torch.device("cpu"))
    assert swap.blocks_to_swap == 4 and not swap.active
    assert "blocks_to_swap = 99 exceeds the model's 4 blocks" in caplog.text
    assert "BlockSwap inactive: the compute device is cpu" in caplog.text


def _upscale(tiny_options, clip, **options):
    options.setdefault("resolution", 32)
    return seedvr2.upscale(clip, **tiny_options, batch_size=5,
                           text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"),
                           **options)


@pytest.fixture(scope="module")
def clip():
    torch.manual_seed(1)
    return torch.rand(6, 16, 24, 3)


def test_swap_options_give_identical_frames(tiny_options, clip):
    plain = _upscale(tiny_options, clip)
    swapped = _upscale(tiny_options, clip, blocks_to_swap=2, swap_io_components=True,
                       dit_offload_device="cpu", vae_offload_device="cpu")
    assert torch.equal(plain, swapped)


def test_swap_needs_offload_device(tiny_options, clip):
    with pytest.raises(OptionError, match=r"need an offload device .* set dit_offload_device"):
        _upscale(tiny_options, clip, blocks_to_swap=2)


def test_model_cache_reuses_and_reloads(tiny_options):
    MODEL_CACHE.clear()
    opts = resolve_options(device="cpu", dtype="fp32", cache_dit=True, cache_vae=True,
                           text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))
    args = (tiny_options["dit"], tiny_options["vae"])
    first = load_models(*args, opts=opts, model_dir=tiny_options["model_dir"])
    again = load_models(*args, opts=opts, model_dir=tiny_options["model_dir"])
    assert again.dit is first.dit and again.vae is first.vae
    changed = load_models(*args, opts=opts.replace(attention_backend="sdpa"),
                          model_dir=tiny_options["model_dir"])
    assert changed.dit is not first.dit and changed.vae is first.vae  # only what changed reloads
    assert len(MODEL_CACHE) == 2
    MODEL_CACHE.clear()
    assert len(MODEL_CACHE) == 0
    uncached = load_models(*args, opts=opts.replace(cache_dit=False, cache_vae=False),
                           model_dir=tiny_options["model_dir"])
    assert len(MODEL_CACHE) == 0 and uncached.dit is not first.dit


def test_compile_aot_eager_matches_and_falls_back(conformance, monkeypatch):
    folder = conformance / "dit3b_tiny"
    case = load_case(folder, "image")
    model = load_dit(folder / "weights.safetensors")
    expected = _forward(model, case)
    apply_compile(model, None, CompileSettings(backend="aot_eager"))
    torch.testing.assert_close(_forward(model, case), expected,
                               atol=dit_bound(model, case, expected), rtol=0)

    broken = load_dit(folder / "weights.safetensors")

    def failing_compile(fn, **kwargs):
        def run(*a, **k):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    apply_compile(broken, None, CompileSettings(backend="inductor"))
    with pytest.warns(UserWarning, match=r"torch.compile \(inductor\) failed for MMDiTBlock, running eager"):
        out = _forward(broken, case)
    assert torch.equal(out, expected)


def _tiny_dit(conformance, num_layers: int):
    """The tiny 3B-family DiT with ``num_layers`` blocks (random weights), windows alternating
    as in the released configs."""
    from seedvr2.models import build_dit

    from conftest import constructor_kwargs
    kwargs = constructor_kwargs(conformance / "dit3b_tiny")
    pattern = list(zip(kwargs["window"], kwargs["window_method"]))[:2]
    kwargs.update(num_layers=num_layers, block_type=["mmdit_sr"] * num_layers,
                  window=[pattern[i % 2][0] for i in range(num_layers)],
                  window_method=[pattern[i % 2][1] for i in range(num_layers)])
    torch.manual_seed(0)
    return build_dit(kwargs).eval()


def _graphs_per_resolution(model, shapes) -> list[int]:
    """Dynamo's unique graph count after each call at the given (t, h, w) latent sizes."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    apply_compile(model, None, CompileSettings(backend="aot_eager"))
    channels = model.config.vid_in_channels
    counts = []
    for t, h, w in shapes:
        with torch.no_grad():
            model(torch.randn(t * h * w, channels), torch.randn(5, model.config.txt_in_dim),
                  torch.tensor([[t, h, w]]), torch.tensor([[5]]), torch.tensor([1000.0]))
        counts.append(counters["stats"]["unique_graphs"])
    return counts


def test_compile_shares_graphs_across_blocks_and_resolutions(conformance):
    """Blocks of one kind share graphs, the first new resolution recompiles once (dynamic
    shapes), and later resolutions compile nothing: the window layout and RoPE tables stay
    outside the graphs."""
    shapes = [(1, 8, 8), (1, 12, 8), (1, 16, 12), (2, 16, 16), (1, 8, 8)]
    six = _graphs_per_resolution(_tiny_dit(conformance, 6), shapes)
    twelve = _graphs_per_resolution(_tiny_dit(conformance, 12), shapes)  # the same block kinds
    assert twelve == six  # twice the blocks, no more graphs
    assert six[1] <= 2 * six[0]  # one dynamic recompile per graph at most
    assert six[2:] == [six[1]] * 3  # no recompiles after that


def test_compile_inductor_smoke(conformance):
    """One real inductor compile of the tiny DiT (tens of seconds on a small CPU)."""
    folder = conformance / "dit3b_tiny"
    case = load_case(folder, "image")
    model = load_dit(folder / "weights.safetensors")
    expected = _forward(model, case)
    apply_compile(model, None, CompileSettings(backend="inductor"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an eager fallback would warn: the compile must work
        out = _forward(model, case)
    # Fused kernels sum in their own order.
    torch.testing.assert_close(out, expected, atol=dit_bound(model, case, expected), rtol=0)


def test_bad_memory_options():
    with pytest.raises(OptionError, match=r"vae_decode_tile_overlap = 512: must be smaller than vae_decode_tile_size"):
        resolve_options(vae_decode_tile_size=512, vae_decode_tile_overlap=512)
    with pytest.raises(OptionError, match=r"compile_backend = 'tvm': expected one of inductor"):
        resolve_options(compile_backend="tvm")
    with pytest.raises(OptionError, match=r"dit_offload_device = 'disk': expected none, cpu, cuda"):
        resolve_options(dit_offload_device="disk")
    with pytest.raises(ValueError, match=r"compile backend 'tvm': expected one of"):
        CompileSettings(backend="tvm")


def test_vae_tiling_options_reach_the_vae(tiny_options, clip, monkeypatch):
    from seedvr2.memory import tiling

    seen = []
    original = tiling.decode

    def spy(vae, latent, tiles, temporal_chunk=None, between=None):
        seen.append((tiles, temporal_chunk))
        return original(vae, latent, tiles, temporal_chunk, between)

    monkeypatch.setattr(tiling, "decode", spy)
    out = _upscale(tiny_options, clip, vae_decode_tiled=True, vae_decode_tile_size=64,
                   vae_decode_tile_overlap=16, vae_encode_tiled=True, vae_encode_tile_size=64,
                   vae_encode_tile_overlap=16)
    assert out.shape == (6, 32, 48, 3)
    assert seen and all(t.enabled and t.tile_size == 64 and t.tile_overlap == 16 and not t.exact
                        and chunk == 4 for t, chunk in seen)  # the official 4-frame slices


def test_exact_tiling_and_temporal_slices_keep_the_frames(tiny_options, clip):
    """Through the whole pipeline: exact tiles and causal temporal slices change nothing
    beyond float rounding."""
    plain = _upscale(tiny_options, clip, resolution=96)  # 96x144: 2x3 tiles of 64 pixels
    changed = _upscale(tiny_options, clip, resolution=96, vae_decode_tiled=True,
                       vae_decode_tile_size=64, vae_decode_tile_overlap=8, vae_encode_tiled=True,
                       vae_encode_tile_size=64, vae_encode_tile_overlap=8, vae_tiling_exact=True,
                       vae_encode_temporal_slice=4, vae_decode_temporal_slice=4)
    # The VAE's sums in another order on both sides of the DiT, which carries the difference
    # through its own layers. Frames are (pixels + 1) / 2 with pixels in [-1, 1]: magnitude 1
    # in pixels, halved in frames; the halving is left as room for activations inside the
    # networks somewhat larger than their outputs.
    vae, dit = load_vae(tiny_options["vae"]), load_dit(tiny_options["dit"])
    lengths = [sum_lengths(vae.encoder), sum_lengths(dit), sum_lengths(vae.decoder)]
    terms, layers = max(t for t, _ in lengths), sum(n for _, n in lengths)
    assert (changed - plain).abs().max() < rounding_bound(1.0, terms=terms, layers=layers)
