"""Property-based hostile tests of frames in memory (issue 33): ``seedvr2.upscale`` and the
upscaler node's IMAGE input take tensors of any dtype, shape, stride, values (NaN, +-inf),
and tensors that require grad. The invariant (tests/hostile.py): the frames upscaled, with the
result of the same values given plainly (contiguous, detached), or one error of ours naming
the frame or the frames' shape/dtype; never another exception.

Each example runs the tiny models on frames of at most 3 x 12 x 12 at resolution 16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import seedvr2
from hostile import outcome

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8,
          torch.uint16, torch.int32, torch.int64, torch.bool]
SPECIAL = [float("nan"), float("inf"), float("-inf")]


@st.composite
def frames(draw):
    """(frames, plain, first non-finite frame or None): ``plain`` the same values as a
    contiguous detached float32/uint tensor (what a careful caller gives)."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = [draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.integers(1, 12)),
             draw(st.sampled_from([1, 3, 4, 2, 0]))]
    shape = shape[draw(st.integers(0, 1)):]  # sometimes one (H, W, C) image
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    values = torch.rand(shape, generator=generator) * draw(st.sampled_from([1.0, 1.0, 1.5]))
    bad = None
    if dtype.is_floating_point and shape[-1] in (1, 3, 4) and draw(st.booleans()):
        index = draw(st.integers(0, values.numel() - 1))
        values.view(-1)[index] = draw(st.sampled_from(SPECIAL))
        bad = index // (values.numel() // values.shape[0]) if len(shape) == 4 else 0
    if dtype in (torch.uint8, torch.int32, torch.int64):
        values = values * 255
    elif dtype == torch.uint16:
        values = values * 65535
    plain = values.to(dtype)
    given = plain
    if draw(st.booleans()) and plain.dim() >= 3:  # another layout, the same values
        given = plain.transpose(-2, -3).contiguous().transpose(-2, -3)
    if draw(st.booleans()) and dtype.is_floating_point:
        given = given.clone().requires_grad_(True)
    return given, plain, bad


def _upscale(tiny_options, value):
    return seedvr2.upscale(value, **tiny_options, resolution=16, batch_size=1,
                           scene_cuts="auto")


@given(case=frames())
def test_frames_in_memory_upscale_as_given_plainly_or_are_refused(tiny_options, case):
    given, plain, bad = case
    with _no_warning_check():
        result = outcome(lambda: _upscale(tiny_options, given))
    if bad is not None:
        assert result.refused, "non-finite frames were upscaled"
        assert result.message == f"frame {bad} contains NaN or infinite values"
        return
    if result.refused:
        message = result.message
        assert "frame" in message and ("shape" in message or "dtype" in message
                                        or "torch." in message or "no frames" in message
                                        or "output size" in message), message
        return
    out = result.value
    assert out.dtype == torch.float32 and not out.requires_grad
    assert out.shape[0] == (plain.shape[0] if plain.dim() == 4 else 1)
    assert torch.isfinite(out).all() and out.min() >= 0 and out.max() <= 1
    if given is not plain:
        with _no_warning_check():
            assert torch.equal(out, _upscale(tiny_options, plain))


class _no_warning_check:  # clamping warnings (values over 1) are expected and fine
    def __enter__(self):
        import warnings
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


# The kinds the issue found, each as one example.

def test_frames_that_require_grad_are_upscaled_like_plain_ones(tiny_options):
    """Scene-cut detection read them with numpy(), which refuses a tensor of a graph."""
    plain = torch.rand(3, 12, 16, 3, generator=torch.Generator().manual_seed(1))
    given = plain.clone().requires_grad_(True)
    assert torch.equal(_upscale(tiny_options, given), _upscale(tiny_options, plain))


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_non_finite_value_is_refused_naming_the_first_frame(tiny_options, value):
    frames = torch.rand(4, 12, 16, 3)
    frames[2, 5, 7, 1] = value
    frames[3, 0, 0, 0] = float("nan")
    with pytest.raises(seedvr2.SeedVR2Error) as refused:
        _upscale(tiny_options, frames)
    assert str(refused.value) == "frame 2 contains NaN or infinite values"


# The upscaler node's IMAGE input: the same frames, through the node as ComfyUI runs it.

@pytest.fixture(scope="module")
def upscaler_node(tiny_model_dir, tmp_path_factory):
    from seedvr2.workflow import nodes as defs
    from seedvr2.workflow.host import HeadlessHost

    host = HeadlessHost(model_dir=tiny_model_dir, output_dir=tmp_path_factory.mktemp("out"),
                        quiet=True)
    nodes = {n.id: n for n in defs.build_nodes()}
    loaded = []
    for kind, name in (("dit", "dit3b_tiny.safetensors"), ("vae", "vae_tiny.safetensors")):
        settings = {s.input: s.node_input().default for s in defs.LOADER_SETTINGS[kind]
                    if not s.node_input().optional}
        node = nodes["SeedVR2LoadDiTModel" if kind == "dit" else "SeedVR2LoadVAEModel"]
        loaded.append(node.run(host, model=name, **{**settings, "dtype": "fp32"}).outputs[0])
    upscaler = nodes["SeedVR2VideoUpscaler"]
    widgets = {i.name: i.default for i in upscaler.inputs if i.is_widget}

    def run(image):
        return upscaler.run(host, image=image, dit=loaded[0], vae=loaded[1], **{
            **widgets, "resolution": 16, "batch_size": 1}).outputs[0]
    return run


@settings(max_examples=settings.default.max_examples // 2)  # 10 in ci
@given(case=frames())
def test_the_image_node_upscales_as_given_plainly_or_refuses_naming_the_frame(upscaler_node,
                                                                               case):
    given, plain, bad = case
    with _no_warning_check():
        result = outcome(lambda: upscaler_node(given))
    if bad is not None:
        assert result.refused and f"frame {bad} contains NaN or infinite values" in \
            result.message, result.message
    elif not result.refused:
        out = result.value
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        if given is not plain:
            with _no_warning_check():
                assert torch.equal(out, upscaler_node(plain))
