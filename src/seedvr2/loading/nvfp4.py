"""nvfp4 weights: E2M1 pairs (``U8``, first value in the high nibble) with one e4m3 scale per
16 values (in cuBLAS' 128x4 tiles) and one fp32 scale per tensor (comfy-kitchen's
``TensorCoreNVFP4Layout``). A linear layer may multiply through comfy-kitchen's
``scaled_mm_nvfp4`` (docs/models.md)."""

from __future__ import annotations

import functools
from typing import Mapping, Optional

import torch

from ..kernels import first_violation, tiled_scales_shape
from .packed import (E4M3_MAX, FLOAT_SCALES, Format, Part, PackedEntry, PackedWeight,
                     Product, Scheme, Target, block_scaled_weight, device_constant, register,
                     swizzle_block_scales, unswizzle_block_scales)

BLOCK = 16
E2M1_MAX = 6.0  # largest e2m1 value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dequantize(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    packed = w.parts["data"]
    rows, half = packed.shape
    cols = 2 * half
    codes = torch.stack([packed >> 4, packed & 0x0F], dim=-1).view(-1)
    # int32 indices: half the bytes of int64 for a gather over every weight value.
    table = device_constant(E2M1_VALUES, torch.float32, packed.device)
    values = torch.index_select(table, 0, codes.to(torch.int32)).view(rows, cols)
    block = unswizzle_block_scales(w.parts["scale"].view(torch.float8_e4m3fn), rows, cols // BLOCK)
    scale = block.to(torch.float32) * w.parts["scale_2"].to(torch.float32).reshape(())
    out = values.view(rows, cols // BLOCK, BLOCK) * scale.unsqueeze(-1)
    return out.view(rows, cols)[: w.shape[0], : w.shape[1]].to(dtype)


@functools.lru_cache(maxsize=256)
def _kernel_rules(shape: tuple) -> Optional[str]:
    rows, cols = shape
    meta = dict(device="meta")
    scales = lambda n: torch.empty(tiled_scales_shape(n, cols // BLOCK),  # noqa: E731
                                   dtype=torch.float8_e4m3fn, **meta)
    one = torch.empty((), dtype=torch.float32, **meta)
    return first_violation("comfy_kitchen.scaled_mm_nvfp4", {
        "a": torch.empty(16, cols // 2, dtype=torch.uint8, **meta),
        "b": torch.empty(rows, cols // 2, dtype=torch.uint8, **meta),
        "tensor_scale_a": one, "tensor_scale_b": one, "alpha": one,
        "block_scale_a": scales(16), "block_scale_b": scales(rows), "out_dtype": torch.bfloat16})


def _product_fits(w: PackedWeight) -> Optional[str]:
    if w.shape[0] % 16:  # torch's block-scaled matmul (the eager backend): N % 16
        return f"{w.shape[0]} output channels, not a multiple of 16"
    return _kernel_rules(tuple(w.shape))


def _product(ck, x2d, weight: PackedWeight, bias):
    x_scale = (x2d.abs().amax().float() / (E4M3_MAX * E2M1_MAX)).clamp_(
        min=torch.finfo(torch.float32).tiny)
    # Rows padded to 16 (the kernel's tile); the padded rows are zero and cut off below.
    codes, scales = ck.quantize_nvfp4(x2d, x_scale, pad_16x=True)
    w_scale = weight.parts["scale_2"].float().reshape(())
    out = ck.scaled_mm_nvfp4(codes, weight.parts["data"], x_scale, w_scale, scales,
                             weight.parts["scale"].view(torch.float8_e4m3fn), bias,
                             out_dtype=x2d.dtype, alpha=x_scale * w_scale)
    return out[: x2d.shape[0]]


NVFP4 = Scheme(
    "nvfp4",
    parts={"data": Part((torch.uint8,), lambda shape, params: [(shape[0], shape[1] // 2)],
                        non_finite=None),
           "scale": Part((torch.float8_e4m3fn, torch.uint8),
                         lambda shape, params: [tiled_scales_shape(shape[0], shape[1] // BLOCK)]),
           "scale_2": Part(FLOAT_SCALES, lambda shape, params: [(), (1,)])},
    dequantize=_dequantize,
    product=Product("nvfp4", ("comfy_kitchen.quantize_nvfp4", "comfy_kitchen.scaled_mm_nvfp4"),
                    _product_fits, _product))


def _read_marker(layer: str, conf: Mapping, shapes, dtypes) -> PackedEntry:
    key, shape = block_scaled_weight(layer, shapes, BLOCK // 2,
                                     "nvfp4 packed pairs of shape (rows, 8·k)")
    return PackedEntry("nvfp4", (shape[0], 2 * shape[1]),
                       {"data": key, "scale": f"{layer}.weight_scale",
                        "scale_2": f"{layer}.weight_scale_2"},
                       {"scale": torch.float8_e4m3fn})


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed e2m1 pairs, swizzled e4m3 block scales, fp32 tensor scale)``: 16 values share
    an e4m3 scale (their absmax / 6, in units of the tensor scale absmax / (448·6)); values
    round to the nearest e2m1 (first of each pair in the high nibble). Bit for bit what
    comfy-kitchen's ``quantize_nvfp4`` writes with the same tensor scale (tested)."""
    rows, cols = weight.shape
    w = weight.to(torch.float32)
    scale_2 = (w.abs().amax() / (E4M3_MAX * E2M1_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    blocks = w.view(rows, cols // BLOCK, BLOCK)
    block = (blocks.abs().amax(-1) / E2M1_MAX / scale_2).to(torch.float8_e4m3fn)
    step = (block.float() * scale_2).unsqueeze(-1)
    scaled = torch.where(step > 0, blocks / torch.where(step > 0, step, 1.0), 0.0)
    # The magnitude's code (0-7) counts the midpoints between neighbouring e2m1 magnitudes it
    # passes; at a midpoint it rounds to the even code, as comfy-kitchen's quantiser does.
    magnitude = scaled.abs().reshape(rows, cols)
    codes = torch.zeros(rows, cols, dtype=torch.uint8, device=weight.device)
    for code, (low, high) in enumerate(zip(E2M1_VALUES[:7], E2M1_VALUES[1:8])):
        middle = (low + high) / 2
        codes += (magnitude > middle if code % 2 == 0 else magnitude >= middle).to(torch.uint8)
    codes |= (scaled.reshape(rows, cols) < 0).to(torch.uint8) << 3  # the sign is bit 3
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    return packed, swizzle_block_scales(block.view(torch.uint8)).view(torch.float8_e4m3fn), \
        scale_2.reshape(())


def _layout(layer: str, shape: tuple[int, ...]):
    rows, cols = shape if len(shape) == 2 else (0, 1)
    if len(shape) != 2 or cols % 32 or rows % 16:  # the shapes its product takes
        return None
    return {"format": "nvfp4"}, {
        f"{layer}.weight": (torch.uint8, (rows, cols // 2)),
        f"{layer}.weight_scale": (torch.float8_e4m3fn, tiled_scales_shape(rows, cols // BLOCK)),
        f"{layer}.weight_scale_2": (torch.float32, ())}


register(Format("nvfp4", (NVFP4,), markers={"nvfp4": _read_marker},
                targets=(Target("nvfp4", _layout, lambda weight, marker: list(
                    quantize_nvfp4(weight))),),
                bytes_per_weight={"nvfp4": 0.5 + 1 / 16}))
