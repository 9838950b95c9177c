"""int8 weights: codes times a per-output-channel (or per-tensor) scale, optionally of the
weight rotated by a block-diagonal regular Hadamard matrix (comfy-kitchen's "ConvRot"), as
ComfyUI's ``int8_tensorwise`` layout stores them; a linear layer may multiply through
comfy-kitchen's ``int8_linear`` (docs/models.md, "Quantised weights in memory")."""

from __future__ import annotations

import functools
import math
from typing import Mapping, Optional

import torch

from ..kernels import first_violation, is_power_of_4
from .packed import (FLOAT_SCALES, Format, LayoutError, Part, PackedEntry, PackedWeight,
                     Product, Scheme, Target, conf_value, register, row_scale,
                     row_scale_shapes)


def regular_hadamard(size: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The normalised regular Hadamard matrix ``H4^{(x)k} / sqrt(size)`` (``size = 4^k``), ``H4``
    symmetric with orthogonal rows: the result is symmetric and orthonormal, its own inverse."""
    if not is_power_of_4(size):
        raise LayoutError(f"a regular Hadamard matrix needs a power of 4 as size, got {size}")
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]],
                      dtype=dtype, device=device)
    h = h4
    for _ in range(round(math.log(size, 4)) - 1):
        h = torch.kron(h, h4)
    return h / (size ** 0.5)


@functools.lru_cache(maxsize=None)
def cached_hadamard(size: int, device: torch.device) -> torch.Tensor:
    """:func:`regular_hadamard` in float32 on ``device``, made once (256 KB for a group of 256)."""
    with torch.inference_mode(False):
        return regular_hadamard(size, device=device)


def _dequantize_rows(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    data = w.parts["data"]  # int8 times fp32 is one exact fp32 kernel
    out = torch.mul(data, row_scale(w.parts["scale"], data.shape[0], data.dim()))
    return out.to(dtype).reshape(w.shape)


def _dequantize_convrot(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    data = w.parts["data"]
    rows, cols = data.shape
    group = int(w.params["group_size"])
    rotated = torch.mul(data, row_scale(w.parts["scale"], rows, 2))
    h = cached_hadamard(group, data.device)  # the file holds W·H per group, and H·H = I
    out = torch.matmul(rotated.view(rows, cols // group, group), h)
    return out.reshape(w.shape).to(dtype)


@functools.lru_cache(maxsize=256)
def _kernel_rules(shape: tuple, scale_numel: int, convrot: bool, group) -> Optional[str]:
    rows, cols = shape
    meta = dict(device="meta")
    return first_violation("comfy_kitchen.int8_linear", {
        "x": torch.empty(16, cols, dtype=torch.bfloat16, **meta),
        "weight": torch.empty(rows, cols, dtype=torch.int8, **meta),
        "weight_scale": torch.empty(scale_numel, dtype=torch.float32, **meta),
        "convrot": convrot, "convrot_groupsize": group})


def _product_fits(w: PackedWeight) -> Optional[str]:
    convrot = w.scheme == "int8_convrot"
    return _kernel_rules(tuple(w.shape), w.parts["scale"].numel(), convrot,
                         w.params.get("group_size") if convrot else 256)


def _product(ck, x2d, weight: PackedWeight, bias):
    convrot = weight.scheme == "int8_convrot"
    return ck.int8_linear(x2d, weight.parts["data"], weight.parts["scale"].float().reshape(-1),
                          bias, out_dtype=x2d.dtype, convrot=convrot,
                          convrot_groupsize=int(weight.params.get("group_size", 256)))


_PRODUCT = Product("int8", ("comfy_kitchen.int8_linear",), _product_fits, _product,
                   half_activations=False)
_PARTS = {"data": Part((torch.int8,), lambda shape, params: [tuple(shape)], non_finite=None),
          "scale": Part(FLOAT_SCALES, row_scale_shapes)}
ROWS = Scheme("int8_rows", _PARTS, _dequantize_rows, product=_PRODUCT)
CONVROT = Scheme("int8_convrot", _PARTS, _dequantize_convrot, product=_PRODUCT)


def _read_marker(layer: str, conf: Mapping, shapes, dtypes) -> PackedEntry:
    key = f"{layer}.weight"
    shape = tuple(shapes[key])
    files = {"data": key, "scale": f"{layer}.weight_scale"}
    convrot = conf_value(conf, "convrot", False)
    if not isinstance(convrot, bool):
        raise LayoutError(f"tensor {layer + '.comfy_quant'!r}: convrot must be true or false; "
                          f"found {convrot!r}"[:300])
    if not convrot:
        return PackedEntry("int8_rows", shape, files)
    group = conf_value(conf, "convrot_groupsize", 256)
    if not is_power_of_4(group):
        raise LayoutError(f"tensor {layer + '.comfy_quant'!r}: convrot_groupsize must be a "
                          f"power of 4 (4, 16, 64, 256, ...); found {group!r}"[:300])
    if len(shape) != 2 or shape[1] % group:
        raise LayoutError(f"tensor {key!r}: ConvRot groups of {group} do not divide its shape "
                          f"{list(shape)} (expected (rows, {group}·k))")
    return PackedEntry("int8_convrot", shape, files, params={"group_size": group})


def _read_by_dtype(key: str, shapes, dtypes) -> Optional[PackedEntry]:
    layer = key[: -len(".weight")]
    scale = next((f"{layer}.{s}" for s in ("weight_scale", "scale_weight")
                  if f"{layer}.{s}" in shapes), None)
    if dtypes[key] != torch.int8 or scale is None:
        return None
    return PackedEntry("int8_rows", tuple(shapes[key]), {"data": key, "scale": scale})


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 codes, fp32 scale (rows, 1))`` with one absmax scale per output channel."""
    w = weight.to(torch.float32).reshape(weight.shape[0], -1)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return codes.reshape(weight.shape), scale


def convrot_group(cols: int) -> Optional[int]:
    """The ConvRot group for ``cols`` input channels: the largest power of 4 up to 256 (the
    group ComfyUI's files use) that divides them, at least 16; None when none does."""
    return next((g for g in (256, 64, 16) if cols % g == 0), None)


def quantize_int8_convrot(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8_rows` of ``W·H`` (``H`` the regular Hadamard matrix per group of
    ``group`` input channels): the rotation spreads outliers over their group."""
    rows, cols = weight.shape
    h = regular_hadamard(group, device=weight.device)
    rotated = (weight.to(torch.float32).view(rows, cols // group, group) @ h).view(rows, cols)
    return quantize_int8_rows(rotated)


def _rows_layout(layer: str, shape: tuple[int, ...]):
    if len(shape) != 2:
        return None
    return {"format": "int8_tensorwise"}, {f"{layer}.weight": (torch.int8, shape),
                                           f"{layer}.weight_scale": (torch.float32, (shape[0], 1))}


def _convrot_layout(layer: str, shape: tuple[int, ...]):
    group = convrot_group(shape[-1]) if len(shape) == 2 else None
    if group is None:
        return None
    marker = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
    return marker, _rows_layout(layer, shape)[1]


register(Format(
    "int8", (ROWS, CONVROT), markers={"int8_tensorwise": _read_marker}, by_dtype=_read_by_dtype,
    targets=(Target("int8", _rows_layout, lambda weight, marker: list(quantize_int8_rows(weight))),
             Target("int8_convrot", _convrot_layout, lambda weight, marker: list(
                 quantize_int8_convrot(weight, marker["convrot_groupsize"])))),
    bytes_per_weight=dict.fromkeys(("int8", "int8_rows", "int8_convrot"), 1)))
