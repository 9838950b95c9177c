"""mxfp8 weights: e4m3 values with one power-of-two (E8M0) scale per 32 along a row, the
scales in cuBLAS' 128x4 tiles (comfy-kitchen's ``TensorCoreMXFP8Layout``), read as ``U8`` or
``F8_E8M0`` and written as ``U8`` (ComfyUI's safetensors reader knows no ``F8_E8M0``). A linear
layer may multiply through comfy-kitchen's ``scaled_mm_mxfp8`` (docs/models.md)."""

from __future__ import annotations

import functools
from typing import Mapping, Optional

import torch

from ..kernels import first_violation, tiled_scales_shape
from .packed import (E4M3_MAX, Format, Part, PackedEntry, PackedWeight, Product, Scheme, Target,
                     block_scaled_weight, register, swizzle_block_scales, unswizzle_block_scales)

BLOCK = 32


def _dequantize(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    data = w.parts["data"]
    rows, cols = data.shape
    exponents = unswizzle_block_scales(w.parts["scale"].view(torch.uint8), rows, cols // BLOCK)
    # E8M0: the byte is a biased fp32 exponent; 0 stands for a zero scale.
    scale = (exponents.to(torch.int32) << 23).view(torch.float32)
    scale = torch.where(exponents == 0, torch.zeros_like(scale), scale)
    out = data.to(torch.float32).view(rows, cols // BLOCK, BLOCK) * scale.unsqueeze(-1)
    return out.view(rows, cols)[: w.shape[0], : w.shape[1]].to(dtype)


@functools.lru_cache(maxsize=256)
def _kernel_rules(shape: tuple) -> Optional[str]:
    rows, cols = shape
    meta = dict(device="meta")
    padded = -(-cols // BLOCK) * BLOCK
    # The activations as the product passes them: rows (and K) padded to 32 (pad_32x).
    a = torch.empty(32, padded, dtype=torch.float8_e4m3fn, **meta)
    b = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, **meta)
    scales = lambda n, k: torch.empty(tiled_scales_shape(n, -(-k // BLOCK)),  # noqa: E731
                                      dtype=torch.float8_e8m0fnu, **meta)
    return first_violation("comfy_kitchen.scaled_mm_mxfp8", {
        "a": a, "b": b, "block_scale_a": scales(32, padded), "block_scale_b": scales(rows, cols),
        "out_dtype": torch.bfloat16})


def _product(ck, x2d, weight: PackedWeight, bias):
    # The CUDA quantiser needs rows in multiples of 32 (the text stream alone has 58): padded
    # with zero rows, which the product's slice drops, as comfy-kitchen's own layout does.
    codes, scales = ck.quantize_mxfp8(x2d, pad_32x=True)
    out = ck.scaled_mm_mxfp8(codes, weight.parts["data"], scales,
                             weight.parts["scale"].view(torch.float8_e8m0fnu), bias,
                             out_dtype=x2d.dtype)
    return out[: x2d.shape[0]]


MXFP8 = Scheme(
    "mxfp8",
    parts={"data": Part((torch.float8_e4m3fn,), lambda shape, params: [tuple(shape)]),
           "scale": Part((torch.uint8, torch.float8_e8m0fnu),
                         lambda shape, params: [tiled_scales_shape(shape[0], shape[1] // BLOCK)])},
    dequantize=_dequantize,
    product=Product("mxfp8", ("comfy_kitchen.quantize_mxfp8", "comfy_kitchen.scaled_mm_mxfp8"),
                    lambda w: _kernel_rules(tuple(w.shape)), _product))


def _read_marker(layer: str, conf: Mapping, shapes, dtypes) -> PackedEntry:
    key, shape = block_scaled_weight(layer, shapes, BLOCK, "an mxfp8 weight of shape (rows, 32·k)")
    return PackedEntry("mxfp8", shape, {"data": key, "scale": f"{layer}.weight_scale"},
                       {"scale": torch.float8_e8m0fnu})


def quantize_mxfp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 values, swizzled E8M0 exponents as uint8)``: each run of 32 values along a row
    shares the smallest power of two that brings its absmax within e4m3's 448."""
    rows, cols = weight.shape
    blocks = weight.to(torch.float32).view(rows, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -127 * E4M3_MAX)
    exponent = (torch.ceil(torch.log2(amax / E4M3_MAX)).to(torch.int32) + 127).clamp(1, 254)
    values = blocks / torch.exp2(exponent.float() - 127).unsqueeze(-1)
    data = values.clamp(-E4M3_MAX, E4M3_MAX).reshape(rows, cols).to(torch.float8_e4m3fn)
    return data, swizzle_block_scales(exponent.to(torch.uint8))


def _layout(layer: str, shape: tuple[int, ...]):
    if len(shape) != 2 or shape[1] % BLOCK:
        return None
    return {"format": "mxfp8"}, {
        f"{layer}.weight": (torch.float8_e4m3fn, shape),
        f"{layer}.weight_scale": (torch.uint8, tiled_scales_shape(shape[0], shape[1] // BLOCK))}


register(Format("mxfp8", (MXFP8,), markers={"mxfp8": _read_marker},
                targets=(Target("mxfp8", _layout, lambda weight, marker: list(
                    quantize_mxfp8(weight))),),
                bytes_per_weight={"mxfp8": 1 + 1 / 32}))
