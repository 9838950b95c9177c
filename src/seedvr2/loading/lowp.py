"""Linear layers multiplied in their weights' own precision through comfy-kitchen.

Each product quantises the activations inside the call (per call, from their own absolute
maxima, on the device: no host sync) to the weights' format and multiplies the stored codes
and scales as they are. Which layers come here is ``memory.compute_path``'s decision; a call
that comfy-kitchen declines (no backend takes those operands) returns None and the layer
dequantises as before. comfy-kitchen is imported on the first product, never with the pack.
"""

from __future__ import annotations

from typing import Optional

import torch

from .quantized import E2M1_MAX, E4M3_MAX, PackedWeight


def _int8(ck, x2d, weight: PackedWeight, bias):
    convrot = weight.scheme == "int8_convrot"
    return ck.int8_linear(x2d, weight.parts["data"], weight.parts["scale"].float().reshape(-1),
                          bias, out_dtype=x2d.dtype, convrot=convrot,
                          convrot_groupsize=int(weight.params.get("group_size", 256)))


def _fp8(ck, x2d, weight: PackedWeight, bias):
    data = weight.parts["data"]
    x_scale = (x2d.abs().amax().float() / E4M3_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    w_scale = weight.parts.get("scale")
    w_scale = (w_scale.float().reshape(()) if w_scale is not None
               else torch.ones((), dtype=torch.float32, device=data.device))
    # data is (N, K) row-major, so data.t() is the column-major (K, N) _scaled_mm wants.
    out = torch._scaled_mm(ck.quantize_per_tensor_fp8(x2d, x_scale), data.t(), scale_a=x_scale,
                           scale_b=w_scale, out_dtype=x2d.dtype)
    return out if bias is None else out + bias.to(out.dtype)


def _mxfp8(ck, x2d, weight: PackedWeight, bias):
    codes, scales = ck.quantize_mxfp8(x2d)
    return ck.scaled_mm_mxfp8(codes, weight.parts["data"], scales,
                              weight.parts["scale"].view(torch.float8_e8m0fnu), bias,
                              out_dtype=x2d.dtype)


def _nvfp4(ck, x2d, weight: PackedWeight, bias):
    x_scale = (x2d.abs().amax().float() / (E4M3_MAX * E2M1_MAX)).clamp_(
        min=torch.finfo(torch.float32).tiny)
    # Rows padded to 16 (the kernel's tile); the padded rows are zero and cut off below.
    codes, scales = ck.quantize_nvfp4(x2d, x_scale, pad_16x=True)
    w_scale = weight.parts["scale_2"].float().reshape(())
    out = ck.scaled_mm_nvfp4(codes, weight.parts["data"], x_scale, w_scale, scales,
                             weight.parts["scale"].view(torch.float8_e4m3fn), bias,
                             out_dtype=x2d.dtype, alpha=x_scale * w_scale)
    return out[: x2d.shape[0]]


PRODUCTS = {"int8": _int8, "fp8": _fp8, "mxfp8": _mxfp8, "nvfp4": _nvfp4}


def low_precision_linear(path: str, x: torch.Tensor, weight: PackedWeight,
                         bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``x @ W.T + bias`` on ``path`` (a key of :data:`PRODUCTS`), or None when comfy-kitchen
    has no backend for these operands."""
    import comfy_kitchen as ck

    x2d = x.reshape(-1, x.shape[-1]).contiguous()  # the quantisers read rows of K values
    if bias is not None:
        bias = bias.to(x.dtype)
    try:
        out = PRODUCTS[path](ck, x2d, weight, bias)
    except ck.BackendError:
        return None
    return out.reshape(*x.shape[:-1], weight.shape[0])
