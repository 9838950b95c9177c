"""The upscaling pipeline: reference maths, batch plan, end-to-end goldens, reproducibility."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import seedvr2
from seedvr2.api import load_models
from seedvr2.options import OptionError, resolve_options
from seedvr2.pipeline import runner as runner_module
from seedvr2.pipeline.plan import blend_weights, make_plan
from seedvr2.pipeline.runner import InputError, Interrupted, Upscaler
from seedvr2.pipeline.sampling import (T, augment_latent, make_condition, timestep_transform,
                                       x0_from_velocity)

from conftest import dit_sum_lengths, rounding_bound, sum_lengths


# ---------------------------------------------------------------------------------------------
# reference maths (conformance README §7)

def test_timestep_tables(conformance):
    data = json.loads((conformance / "pipeline" / "pipeline.json").read_text())
    # The reference rounds each step of the shift (u = t/T, two products, a quotient) in
    # float32 at magnitudes up to T = 1000; the uniform trailing timesteps (e.g. 4: 1000, 750,
    # 500, 250; a multi-step sampler's, which SeedVR2's one step does not need) one product.
    for row in data["timestep_transform"]:
        got = timestep_transform(torch.tensor(row["t_in"]), row["latent_shape_thw"]).item()
        assert got == pytest.approx(row["t_out"], abs=rounding_bound(1000.0, terms=1, layers=4)), row
    for steps, expected in data["sampling_timesteps_by_steps"].items():
        steps = int(steps)
        uniform = torch.arange(steps, 0, -1, dtype=torch.float32) * (T / steps)
        torch.testing.assert_close(uniform, torch.tensor(expected),
                                   atol=rounding_bound(1000.0, terms=1), rtol=0)


def test_condition_augmentation_and_sampler(conformance):
    m = load_file(conformance / "pipeline" / "math.safetensors")
    # (1 - t)·latent + t·noise: a 2-term sum, with t itself rounded in the reference's float32
    # (one more rounding carried through the products): at the inputs' magnitude.
    magnitude = max(m["inputs.latent_lr"].abs().max().item(), m["inputs.aug_noise"].abs().max().item())
    bound = rounding_bound(magnitude, terms=2, layers=2)
    for scale, name in ((0.0, "0"), (0.25, "0p25")):
        latent = augment_latent(m["inputs.latent_lr"], m["inputs.aug_noise"], scale)
        torch.testing.assert_close(latent, m[f"outputs.latent_blur_noise_scale_{name}"],
                                   atol=bound, rtol=0)
        torch.testing.assert_close(make_condition(latent), m[f"outputs.cond_noise_scale_{name}"],
                                   atol=bound, rtol=0)
    assert torch.equal(x0_from_velocity(m["inputs.noise"], m["inputs.v_pred"]),
                       m["outputs.x0_from_one_step_sampler"])


# ---------------------------------------------------------------------------------------------
# batch plan

def test_plan_batches_overlap_and_padding():
    plan = make_plan(23, resolve_options(batch_size=9, temporal_overlap=2, scene_cuts="off"))
    assert [(b.start, b.stop, b.length, b.overlap) for b in plan.batches] == \
        [(0, 9, 9, 0), (7, 16, 9, 2), (14, 23, 9, 2)]
    plan = make_plan(12, resolve_options(batch_size=9, scene_cuts="off"))
    assert [(b.start, b.stop, b.length) for b in plan.batches] == [(0, 9, 9), (9, 12, 5)]
    plan = make_plan(12, resolve_options(batch_size=9, uniform_batch_size=True, scene_cuts="off"))
    assert plan.batches[-1].length == 9


def test_plan_prepend_and_chunks():
    plan = make_plan(10, resolve_options(batch_size=5, prepend_frames=3, chunk_size=10,
                                         scene_cuts="off"))
    assert [plan.source_index(i) for i in range(6)] == [3, 2, 1, 0, 1, 2]
    assert plan.plan_frames == 13
    assert plan.chunks == ((0, 1), (2,))
    assert make_plan(2, resolve_options(prepend_frames=5, scene_cuts="off")).prepend == 1


def test_blend_weights():
    # A raised cosine: a few float32 roundings per weight (the cosine within an ulp), no sums.
    bound = rounding_bound(1.0, terms=1, layers=4)
    assert blend_weights(1).tolist() == [0.5]
    torch.testing.assert_close(blend_weights(2), torch.tensor([1 / 3, 2 / 3]), atol=bound, rtol=0)
    w = blend_weights(5)
    assert torch.all(w[1:] > w[:-1]) and 0 < w[0] < 0.1 and 0.9 < w[-1] < 1
    torch.testing.assert_close(w + w.flip(0), torch.ones(5), atol=bound, rtol=0)


def test_option_errors():
    with pytest.raises(OptionError, match=r"batch_size = 8: must be 4n\+1 .* nearest valid values: 5 or 9"):
        resolve_options(batch_size=8)
    with pytest.raises(OptionError, match=r"color_correction = 'sepia': expected one of lab, wavelet"):
        resolve_options(color_correction="sepia")
    with pytest.raises(OptionError, match=r"unknown option 'batchsize'; did you mean 'batch_size'\?"):
        resolve_options(batchsize=5)
    with pytest.raises(OptionError, match=r"temporal_overlap = 5: must be smaller than batch_size \(5\)"):
        resolve_options(temporal_overlap=5)


# ---------------------------------------------------------------------------------------------
# end to end with the tiny models

@pytest.mark.parametrize("case", ["e2e_video_9f", "e2e_image_1f"])
def test_end_to_end_matches_reference(conformance, tiny_options, monkeypatch, case):
    """The whole Upscaler with the reference's noise and the posterior mean (eps = 0)."""
    data = load_file(conformance / "pipeline" / f"{case}.safetensors")
    noise = data["inputs.noise"]

    def reference_draws(shape, seed, device, dtype=torch.float32):
        if tuple(shape) == tuple(noise.shape):
            return noise.to(device, dtype)
        return torch.zeros(shape, device=device, dtype=dtype)  # eps = 0: the posterior mean

    monkeypatch.setattr(runner_module, "_randn", reference_draws)
    opts = resolve_options(resolution=data["inputs.video_cthw"].shape[-2], batch_size=9,
                           color_correction="wavelet", device="cpu", dtype="fp32",
                           text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"),
                           scene_cuts="off")
    models = load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                         model_dir=tiny_options["model_dir"])
    models.text = data["inputs.txt_pos"]  # each case has its own random text
    frames = ((data["inputs.video_cthw"].permute(1, 2, 3, 0) + 1) / 2)
    upscaler = Upscaler(models, opts)
    out = torch.cat([o for _, o in upscaler.run(iter(frames), make_plan(len(frames), opts))])
    expected = (data["outputs.frames_final_clipped"].permute(0, 2, 3, 1) + 1) / 2
    # Encoder, DiT and decoder, each summing in its own order (the colour fix adds 12 9-term
    # sums, within this): at pixel magnitude 1, halved into frames (the halving left as room
    # for activations somewhat larger than the outputs).
    lengths = [sum_lengths(models.vae.encoder), dit_sum_lengths(models.dit, {
        "inputs.vid": torch.empty(data["inputs.noise"].numel() // 16, 1),
        "inputs.txt": models.text}), sum_lengths(models.vae.decoder)]
    terms, layers = max(t for t, _ in lengths), sum(n for _, n in lengths)
    bound = rounding_bound(1.0, terms=terms, layers=layers)
    print(f"{case}: max abs {(out - expected).abs().max().item():.2e}, bound {bound:.2e}")
    torch.testing.assert_close(out, expected, atol=bound, rtol=0)


@pytest.fixture(scope="module")
def clip():
    torch.manual_seed(0)
    x = torch.linspace(0, 1, 40)
    frames = torch.stack([(x[None, :, None] * x[:, None, None] * 0.8 + 0.1 * t / 11).expand(40, 40, 3)
                          for t in range(11)])
    return frames[:, :24, :32].contiguous()  # (11, 24, 32, 3)


def _run(clip, tiny_options, **options):
    return seedvr2.upscale(clip, **tiny_options, resolution=48,
                           text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"),
                           **options)


def test_video_size_count_and_reproducibility(clip, tiny_options):
    a = _run(clip, tiny_options, batch_size=5, temporal_overlap=2, seed=7)
    assert a.shape == (11, 48, 64, 3) and a.dtype == torch.float32
    assert 0 <= a.min() and a.max() <= 1
    b = _run(clip, tiny_options, batch_size=5, temporal_overlap=2, seed=7, chunk_size=100)
    assert torch.equal(a, b)  # chunking never changes results
    c = _run(clip, tiny_options, batch_size=5, temporal_overlap=2, seed=8)
    assert (a - c).abs().max() > 1e-3  # the seed does


def test_rgba_gray_and_prepend(clip, tiny_options):
    alpha = torch.ones(11, 24, 32, 1)
    alpha[:, :, :16] = 0
    rgba = _run(torch.cat([clip, alpha], -1), tiny_options, batch_size=5, color_correction="none")
    assert rgba.shape == (11, 48, 64, 4)
    assert rgba[..., 3][:, :, :28].max() == 0 and rgba[..., 3][:, :, 36:].min() == 1
    gray = _run(clip[..., :1], tiny_options, batch_size=5, prepend_frames=3)
    assert gray.shape == (11, 48, 64, 1)


def test_interrupt_and_progress(clip, tiny_options):
    events = []
    with pytest.raises(Interrupted):
        _run(clip, tiny_options, batch_size=5, progress=lambda *e: events.append(e),
             should_stop=lambda: len(events) >= 2)
    assert events == [("encode", 1, 3), ("dit", 1, 3)]  # stopped before the first decode


@pytest.mark.parametrize("frames,message", [
    (torch.zeros(0, 24, 32, 3), "the input has no frames"),
    (torch.zeros(2, 24, 32, 2), r"frames have shape \(2, 24, 32, 2\): expected \(T, H, W, C\) with "
                                r"T, H and W at least 1 and C = 1"),
    (torch.full((2, 24, 32, 3), float("nan")), "frame 0 contains NaN or infinite values"),
])
def test_bad_frames(tiny_options, frames, message):
    with pytest.raises(ValueError, match=message):
        _run(frames, tiny_options)


@pytest.mark.parametrize("shape", [(5, 0, 48, 3), (5, 32, 0, 3)])
def test_empty_frames_are_refused_before_any_model_loads(tmp_path, shape):
    """A model path that does not exist proves nothing was loaded before the check."""
    missing = str(tmp_path / "missing.safetensors")
    expected = (f"frames have shape {shape}: expected (T, H, W, C) with T, H and W at least 1 "
                f"and C = 1 (gray), 3 (RGB) or 4 (RGBA)")
    with pytest.raises(InputError) as caught:
        seedvr2.upscale(torch.zeros(shape), missing, missing, device="cpu")
    assert str(caught.value) == expected


def _ramp(levels: int) -> torch.Tensor:
    """Two 24x32 frames whose values step through 0..levels-1."""
    return torch.arange(2 * 24 * 32 * 3).reshape(2, 24, 32, 3) * 37 % levels


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_integer_frames_get_the_scale_of_their_values(tiny_options, dtype):
    eight_bit = _ramp(256)
    expected = _run(eight_bit.to(torch.uint8), tiny_options)
    assert torch.equal(_run(eight_bit.to(dtype), tiny_options), expected)
    if dtype != torch.int16:  # int16 stops at 32767, inside the 16-bit range
        sixteen_bit = _ramp(65536)
        assert torch.equal(_run(sixteen_bit.to(dtype), tiny_options),
                           _run(sixteen_bit.to(torch.int32).to(torch.uint16), tiny_options))


@pytest.mark.parametrize("values,found", [((-1, 3), "-1..3"), ((0, 70000), "0..70000")])
def test_integer_frames_outside_both_scales_are_refused(values, found):
    frames = torch.tensor(values, dtype=torch.int64).repeat(2 * 24 * 16 * 3 // 2)
    with pytest.raises(InputError) as caught:
        seedvr2.upscale(frames.reshape(2, 24, 16, 3), device="cpu")
    assert str(caught.value) == (
        f"frames are torch.int64 with values {found}: integer frames must be 0..255 (8-bit) or "
        f"0..65535 (16-bit); give float32 in [0, 1] for anything else")


def test_floats_outside_the_unit_range_are_clamped_with_one_warning(tiny_options):
    frames = _ramp(256).float() / 255
    frames[1, 0, 0] = torch.tensor([1.5, -0.25, 0.5])
    with pytest.warns(UserWarning) as caught:
        out = _run(frames, tiny_options)
    assert [str(w.message) for w in caught] == [
        "frames: 1 of 2 have values outside [0, 1] (frame 1: -0.25..1.5); they are clamped to "
        "[0, 1]"]
    assert torch.equal(out, _run(frames.clamp(0, 1), tiny_options))


def test_frames_of_different_sizes(tiny_options):
    frames = [torch.zeros(24, 32, 3), torch.zeros(24, 30, 3)]
    with pytest.raises(InputError, match=r"frame 1 has shape \(24, 30, 3\) but frame 0 has \(24, 32, 3\)"):
        opts = resolve_options(batch_size=5, resolution=48, device="cpu", dtype="fp32",
                               text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"),
                               scene_cuts="off")
        models = load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                             model_dir=tiny_options["model_dir"])
        list(Upscaler(models, opts).run(iter(frames), make_plan(2, opts)))


def test_tiny_output_and_text_width(clip, tiny_options):
    from seedvr2.loading.text import BUNDLED_TEXT_EMBEDDINGS

    with pytest.raises(OptionError, match=r"resolution = 8: must be at least 16"):
        resolve_options(resolution=8)
    with pytest.raises(InputError, match=r"output size 16x12 is under 16 px on its short edge"):
        _run(clip, tiny_options, max_resolution=16)
    with pytest.raises(ValueError, match=r"text embeddings have width 5120 but the DiT expects txt_in_dim 64"):
        seedvr2.upscale(clip, **tiny_options, text_embeddings=str(BUNDLED_TEXT_EMBEDDINGS))
