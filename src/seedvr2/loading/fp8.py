"""fp8 weights (e4m3fn, e5m2), plain casts or times a per-tensor or per-channel scale: numz's
plain fp8 files, ComfyUI's ``float8_*`` layouts and the legacy ``scale_weight``. e4m3 weights
with a per-tensor scale may multiply through ``torch._scaled_mm`` (docs/models.md)."""

from __future__ import annotations

import functools
from typing import Mapping, Optional

import torch

from ..kernels import first_violation
from .packed import (E4M3_MAX, FLOAT_SCALES, Format, LayoutError, Part, PackedEntry,
                     PackedWeight, Product, Scheme, Target, dtype_name, register, row_scale,
                     row_scale_shapes)

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
TARGETS = {"fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _dequantize(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    data = w.parts["data"]
    scale = w.parts.get("scale")
    if scale is None:  # fp8 values are exact in fp16, bf16 and fp32: one cast
        return data.to(dtype).reshape(w.shape)
    scale = row_scale(scale, data.shape[0], data.dim())
    return (data.to(torch.float32) * scale).to(dtype).reshape(w.shape)


def _label(params, dtypes) -> str:
    return dtype_name(dtypes["data"]) + ("_scaled" if "scale" in dtypes else "")


def _product_fits(w: PackedWeight) -> Optional[str]:
    """Why the fp8 product (per-tensor scales, ``torch._scaled_mm``) cannot take ``w``."""
    if w.parts["data"].dtype != torch.float8_e4m3fn:
        return "e5m2 weights (the product quantises activations to e4m3)"
    scale = w.parts.get("scale")
    if scale is not None and scale.numel() != 1:
        return "a per-channel weight scale (the product takes one scale per tensor)"
    return _kernel_rules(tuple(w.shape))


@functools.lru_cache(maxsize=256)
def _kernel_rules(shape: tuple) -> Optional[str]:
    """``torch._scaled_mm``'s rules for a weight of ``shape`` (N, K), activations of any rows."""
    rows, cols = shape
    meta = torch.empty(16, cols, dtype=torch.float8_e4m3fn, device="meta")
    weight = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device="meta")
    scale = torch.empty((), dtype=torch.float32, device="meta")
    return first_violation("torch._scaled_mm", {"self": meta, "mat2": weight.t(),
                                                "scale_a": scale, "scale_b": scale})


def _product(ck, x2d, weight: PackedWeight, bias):
    data = weight.parts["data"]
    x_scale = (x2d.abs().amax().float() / E4M3_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    w_scale = weight.parts.get("scale")
    w_scale = (w_scale.float().reshape(()) if w_scale is not None
               else torch.ones((), dtype=torch.float32, device=data.device))
    # data is (N, K) row-major, so data.t() is the column-major (K, N) _scaled_mm wants.
    out = torch._scaled_mm(ck.quantize_per_tensor_fp8(x2d, x_scale), data.t(), scale_a=x_scale,
                           scale_b=w_scale, out_dtype=x2d.dtype)
    return out if bias is None else out + bias.to(out.dtype)


FLOAT = Scheme(
    "float",
    parts={"data": Part(tuple(FP8.values()), lambda shape, params: [tuple(shape)]),
           "scale": Part(FLOAT_SCALES, row_scale_shapes, optional=True)},
    dequantize=_dequantize, label=_label,
    product=Product("fp8", ("comfy_kitchen.quantize_per_tensor_fp8", "torch._scaled_mm"),
                    _product_fits, _product))


def _read_marker(layer: str, conf: Mapping, shapes, dtypes) -> PackedEntry:
    fmt = conf["format"]
    key = f"{layer}.weight"
    if dtypes[key] != FP8[fmt]:
        raise LayoutError(f"tensor {key!r}: the layer is marked {fmt}; found "
                          f"{dtype_name(dtypes[key])}")
    scale = f"{layer}.weight_scale"
    return PackedEntry("float", tuple(shapes[key]),
                       {"data": key, **({"scale": scale} if scale in shapes else {})})


def _read_by_dtype(key: str, shapes, dtypes) -> Optional[PackedEntry]:
    if dtypes[key] not in FP8.values():
        return None
    layer = key[: -len(".weight")]
    scale = next((f"{layer}.{s}" for s in ("weight_scale", "scale_weight")
                  if f"{layer}.{s}" in shapes), None)
    return PackedEntry("float", tuple(shapes[key]),
                       {"data": key, **({"scale": scale} if scale else {})})


def quantize_fp8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values, fp32 scale)`` with ``weight ≈ values·scale`` (per-tensor absmax scale)."""
    largest = torch.finfo(dtype).max
    w = weight.to(torch.float32)
    scale = (w.abs().amax() / largest).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-largest, largest).to(dtype), scale.reshape(())


def _target(name: str) -> Target:
    fmt = TARGETS[name]

    def layout(layer: str, shape: tuple[int, ...]):
        return {"format": fmt}, {f"{layer}.weight": (FP8[fmt], shape),
                                 f"{layer}.weight_scale": (torch.float32, ())}

    return Target(name, layout, lambda weight, marker: list(quantize_fp8(weight, FP8[fmt])))


register(Format("fp8", (FLOAT,), markers={fmt: _read_marker for fmt in FP8},
                by_dtype=_read_by_dtype, targets=tuple(_target(t) for t in TARGETS),
                bytes_per_weight=dict.fromkeys(
                    ("fp8", "fp8_e4m3fn", "float8_e4m3fn", "float8_e5m2",
                     "float8_e4m3fn_scaled", "float8_e5m2_scaled"), 1)))
