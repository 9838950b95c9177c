"""Which arithmetic a quantised linear layer multiplies in, decided per layer and device:
``weights`` (dequantise to the compute dtype) or, with ``compute_precision auto``, its format's
low-precision product through comfy-kitchen (each format's :class:`~.packed.Product`). The platform
decides first (ROCm reports SM-shaped capabilities that are not NVIDIA's), then each kernel's
compute capability, or on AMD what comfy-kitchen registers (``seedvr2.kernels``), then the weight's
fit. Products quantise the activations from their absolute maxima on the device (no host sync); a
failed one is the caller's to fall back from (``packed_layers``). Paths, GPUs and error bounds:
docs/memory.md, "Quantised weights: compute_precision"."""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels
from .packed import PackedWeight, scheme_of
from .format_table import SCHEMES  # noqa: F401 -- every format's product registered

COMPUTE_PRECISIONS = ("auto", "weights")
WEIGHTS = "weights"
_HALF_FLOATS = (torch.float16, torch.bfloat16)


def compute_path(weight: PackedWeight, x_dtype: torch.dtype, device: torch.device,
                 precision: str) -> str:
    """The path a linear layer with packed ``weight`` takes for activations of ``x_dtype`` on
    ``device``: ``weights`` (dequantise) or its format's low-precision path."""
    if precision == WEIGHTS or not kernels.kitchen_installed():
        return WEIGHTS
    product = scheme_of(weight.scheme).product
    if product is None or (product.half_activations and x_dtype not in _HALF_FLOATS):
        return WEIGHTS
    if kernels.runs_on(product.kernels, kernels.platform_of(device)) is not None:
        return WEIGHTS
    if len(weight.shape) != 2 or product.fits(weight) is not None:
        return WEIGHTS
    return product.path


def low_precision_linear(x: torch.Tensor, weight: PackedWeight,
                         bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ W.T + bias`` through the low-precision product of ``weight``'s format."""
    ck = kernels.kitchen()
    x2d = x.reshape(-1, x.shape[-1]).contiguous()  # the quantisers read rows of K values
    if bias is not None:
        bias = bias.to(x.dtype)
    out = scheme_of(weight.scheme).product.run(ck, x2d, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])
