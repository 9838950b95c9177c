"""Quantised layers on the device: constant tables made once per device, int32 gathers, and
the fp8 product's arithmetic (torch._scaled_mm runs on the CPU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from seedvr2.loading import int8, packed
from seedvr2.loading.gguf import dequantize_blocks
from seedvr2.loading.lowp import low_precision_linear
from seedvr2.loading.packed_layers import PackedWeight
from seedvr2.loading.packed import swizzle_block_scales


class _Ops(TorchDispatchMode):
    """Records every aten op and the dtypes of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), [(o.dtype, o.numel()) for o in outs if isinstance(o, torch.Tensor)]))
        return out


def _nvfp4(rows=32, cols=64) -> PackedWeight:
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    block = torch.rand(rows, cols // 16, generator=gen).to(torch.float8_e4m3fn)
    return PackedWeight("nvfp4", (rows, cols), {
        "data": data, "scale": swizzle_block_scales(block.view(torch.uint8)).view(torch.float8_e4m3fn),
        "scale_2": torch.tensor(0.5)})


def test_nvfp4_gathers_with_int32_and_makes_its_table_once():
    weight = _nvfp4()
    first = weight.dequantize()
    with _Ops() as ops:
        again = weight.dequantize()
    assert torch.equal(first, again)
    # No int64 tensor as large as the weight (the old codes.long() index), and no table
    # built from host values (aten.lift_fresh / _to_copy of a fresh constant) on this call.
    big_int64 = [op for op, outs in ops.ops for dtype, n in outs
                 if dtype == torch.int64 and n >= weight.shape[0] * weight.shape[1]]
    assert big_int64 == []
    assert not any("lift_fresh" in op for op, _ in ops.ops)
    assert any("index_select" in op for op, _ in ops.ops)


def test_constant_tables_are_made_once_per_device(monkeypatch):
    made = []
    real = torch.tensor

    def counting(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)
    weight = _nvfp4()
    packed.device_constant.cache_clear()
    int8.cached_hadamard.cache_clear()
    monkeypatch.setattr(torch, "tensor", counting)
    for _ in range(3):
        weight.dequantize()
    rot = PackedWeight("int8_convrot", (4, 16), {"data": torch.ones(4, 16, dtype=torch.int8),
                                                 "scale": torch.ones(4, 1)}, {"group_size": 16})
    for _ in range(3):
        rot.dequantize()
    blocks = torch.zeros(2, 18, dtype=torch.uint8)  # IQ4_NL: 2 bytes scale + 16 code bytes
    for _ in range(3):
        dequantize_blocks(blocks, "IQ4_NL")
    assert len(made) == 3  # the E2M1 table, H4 for the Hadamard product, the IQ4 table


def _e4m3(rows=32, cols=64, scale=True) -> PackedWeight:
    data = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)) * 100).to(torch.float8_e4m3fn)
    parts = {"data": data}
    if scale:
        parts["scale"] = torch.tensor(0.01)
    return PackedWeight("float", (rows, cols), parts)


def test_fp8_linear_matches_the_dequantised_product():
    """The fp8 path (comfy-kitchen quantises x, torch._scaled_mm multiplies) runs on the CPU
    too, so the arithmetic is checked here (the dispatch is tests/test_compute_path.py's).

    Bound: only x is rounded (the weight is used as stored), to e4m3's 3 mantissa bits: a
    relative error e_k within ±2⁻⁴, about uniform, so of standard deviation 2⁻⁴/√3. An output
    Σ w_k·x_k·(1 + e_k) of random-sign terms then errs with standard deviation
    2⁻⁴/√3 · √(Σ w_k² x_k²) ≈ 0.036 · (the outputs' RMS). Over 672 outputs the largest error
    stays within 4 standard deviations (bf16 output rounding, 2⁻⁹, is negligible).
    """
    weight = _e4m3()
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    bias = torch.randn(32).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), weight.dequantize(), bias.float())
    pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (the kitchen extra) not installed")
    got = low_precision_linear(x, weight, bias)
    assert got.shape == (3, 7, 32) and got.dtype == torch.bfloat16
    rms = (expected - bias.float()).square().mean().sqrt()
    assert (got.float() - expected).abs().max() < 4 * 2 ** -4 / 3 ** 0.5 * rms
