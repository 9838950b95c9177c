"""Host syncs of a DiT forward, counted without a GPU.

``meta`` stands in for the GPU: every host read of device data (``.tolist()``, ``.item()``,
``repeat_interleave`` without ``output_size``, boolean indexing...) raises on ``meta``, so a
forward that completes there reads nothing back. Copies from the host are counted by
wrapping the two ways tensors reach a device (``Tensor.to`` and ``torch.tensor``): on CUDA
each one from pageable memory waits for the stream to drain.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from seedvr2.models import build_dit
from seedvr2.models import window as window_module

from conftest import load_case


class HostCopies:
    """Counts tensors created on a non-CPU device from host data."""

    def __init__(self, monkeypatch):
        self.count = 0
        real_to, real_tensor = torch.Tensor.to, torch.tensor

        def to(tensor, *args, **kwargs):
            out = real_to(tensor, *args, **kwargs)
            if tensor.device.type == "cpu" and out.device.type != "cpu":
                self.count += 1
            return out

        def tensor(data, *args, **kwargs):
            out = real_tensor(data, *args, **kwargs)
            if out.device.type != "cpu":
                self.count += 1
            return out
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch, "tensor", tensor)


def _meta_dit(conformance, num_layers: int, family: str = "dit3b_tiny"):
    kwargs = copy.deepcopy(json.loads((conformance / family / "config.json").read_text())
                           ["constructor_kwargs"])
    for key in ("block_type", "window", "window_method"):
        kwargs[key] = [kwargs[key][i % len(kwargs[key])] for i in range(num_layers)]
    kwargs["num_layers"] = num_layers
    with torch.device("meta"):
        return build_dit(kwargs).eval()


def _inputs(case):
    """The case's inputs with data on ``meta`` and shapes on the CPU (host facts, as the
    pipeline passes them)."""
    meta = lambda name: case[name].to("meta")  # noqa: E731
    return (meta("inputs.vid"), meta("inputs.txt"), case["inputs.vid_shape"],
            case["inputs.txt_shape"], meta("inputs.timestep"))


def _forward(model, inputs):
    with torch.no_grad():
        return model(*inputs)


@pytest.mark.parametrize("family", ["dit3b_tiny", "dit7b_tiny"])
@pytest.mark.parametrize("num_layers", [2, 8])
def test_dit_forward_reads_nothing_back_and_copies_a_constant(conformance, num_layers, family,
                                                              monkeypatch):
    """Two samples (the per-token expansion path) and both window rules, for the 3B and the
    7B (whose window-local RoPE looks positions up per window extent). Before: a copy per
    block for the text lengths, per modulation for the per-token counts, five per layout and
    per window group, and a readback (repeat_interleave sizing) per modulation; for the 7B,
    a readback of the window extents per axis and rule, and a masked assignment (a sync) per
    extent."""
    window_module._layouts.clear()
    model = _meta_dit(conformance, num_layers, family)
    case = load_case(conformance / family, "batch2_mixed")
    inputs = _inputs(case)
    copies = HostCopies(monkeypatch)
    out = _forward(model, inputs)
    assert out.device.type == "meta" and out.shape == (case["inputs.vid"].shape[0], 16)
    # One for the packing's small index tensors, one per window rule (2 rules).
    assert copies.count == 3
    first = copies.count
    _forward(model, inputs)
    assert copies.count - first == 1  # the layouts of an equal-shaped call are kept


def test_pixel_rope_positions_are_the_reference_lookup():
    """The 7B's window-local positions, selected per host-known extent, equal the direct
    lookup ``linspace(-1, 1, extent)[i]`` token by token, bit for bit."""
    from seedvr2.models.rope import PixelRoPE3d

    window_module._layouts.clear()
    layout = window_module.layout_for("720pswin_by_size_bysize", (4, 3, 3),
                                      [(3, 7, 11), (1, 5, 4)], [3, 2], torch.device("cpu"))
    assert len(layout.extents[1]) > 1  # shifted windows: several extents on an axis
    pos = PixelRoPE3d.video_positions(layout, torch.tensor([3, 2]))
    for token in range(len(pos)):
        for axis in range(3):
            size = int(layout.window_size[token, axis])
            expected = torch.linspace(-1.0, 1.0, size)[int(layout.local_pos[token, axis])]
            assert pos[token, axis].item() == expected.item()


def test_kept_layouts_are_per_shape_and_bounded(monkeypatch):
    window_module._layouts.clear()
    monkeypatch.setattr(window_module, "LAYOUT_CACHE_SIZE", 2)
    cpu = torch.device("cpu")
    rule = ("720pwin_by_size_bysize", (4, 3, 3))
    a = window_module.layout_for(*rule, [(2, 6, 8)], [3], cpu)
    a.cache["rope"] = "per-call value"
    again = window_module.layout_for(*rule, [(2, 6, 8)], [3], cpu)
    assert again.perm is a.perm and again.cache == {}  # same tensors, fresh per-call cache
    other = window_module.layout_for(*rule, [(2, 6, 10)], [3], cpu)
    assert other.perm.numel() == 2 * 6 * 10
    window_module.layout_for(*rule, [(1, 6, 8)], [3], cpu)  # evicts the oldest, (2, 6, 8)
    assert window_module.layout_for(*rule, [(2, 6, 8)], [3], cpu).perm is not a.perm
    built = window_module.WindowLayout.build(*rule, [(2, 6, 8)], [3], cpu)
    for name in ("perm", "local_pos", "window_size", "sample_of_token", "txt_windows"):
        assert torch.equal(getattr(built, name), getattr(a, name)), name


def test_kept_layouts_are_plain_tensors_even_when_made_in_inference_mode():
    """A layout made under inference mode (the pipeline) is kept and may be reused where
    autograd records (tests, training): inference tensors cannot be saved for backward."""
    window_module._layouts.clear()
    rule = ("720pwin_by_size_bysize", (4, 3, 3))
    with torch.inference_mode():
        window_module.layout_for(*rule, [(2, 6, 8)], [3], torch.device("cpu"))
    layout = window_module.layout_for(*rule, [(2, 6, 8)], [3], torch.device("cpu"))
    tensors = [layout.perm, layout.local_pos, layout.window_size, layout.sample_of_token,
               layout.txt_windows, *(g.txt_index for g in layout.groups)]
    assert not any(t.is_inference() for t in tensors)
    x = torch.randn(96, 4, requires_grad=True)
    x[layout.perm].sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_host_to_cuda_copies_are_pinned_and_non_blocking(monkeypatch):
    """The CUDA branch of to_device, with the CUDA calls recorded instead of run: the values
    are pinned first and copied without blocking the host (a pageable copy would wait for the
    stream to drain)."""
    from seedvr2.models.window import to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: calls.append(("to", a, kw)) or self)
    to_device(torch.arange(3), torch.device("cuda", 1))
    assert calls == ["pin", ("to", (torch.device("cuda", 1),), {"non_blocking": True})]
    calls.clear()
    to_device(torch.arange(3), torch.device("cpu"))
    assert calls == [("to", (torch.device("cpu"),), {})]
    calls.clear()  # a tensor already on a device (pinning one raises): moved as it is
    to_device(torch.arange(3, device="meta"), torch.device("cuda", 1))
    assert calls == [("to", (torch.device("cuda", 1),), {})]
