"""Which arithmetic a quantised linear layer multiplies in, decided in one place per layer
and device: ``weights`` (dequantise to the compute dtype) or, with ``compute_precision auto``
on a GPU of :data:`MIN_CAPABILITY`, comfy-kitchen's low-precision product for the weights'
format (``loading.lowp``). Paths, GPUs and error bounds: docs/memory.md, "Quantised weights:
compute_precision".
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch

COMPUTE_PRECISIONS = ("auto", "weights")
WEIGHTS = "weights"

# The first compute capability whose tensor cores multiply each path's operands.
MIN_CAPABILITY = {"int8": (8, 0), "fp8": (8, 9), "mxfp8": (10, 0), "nvfp4": (10, 0)}
_HALF_FLOATS = (torch.float16, torch.bfloat16)


@functools.cache
def kitchen_installed() -> bool:
    """Whether comfy-kitchen can be imported (looked up, not imported: importing it loads
    its kernels, which only a low-precision product needs)."""
    return importlib.util.find_spec("comfy_kitchen") is not None


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """A CUDA device's compute capability; None for every other device."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def weight_path(scheme: str, parts, shape: tuple[int, ...], params) -> Optional[str]:
    """The low-precision path a packed weight's layout could take on a capable GPU (None:
    dequantise), from its storage scheme and the constraints of the kernels."""
    if len(shape) != 2:
        return None
    rows, cols = shape
    if scheme == "int8_rows":
        return "int8"
    if scheme == "int8_convrot":
        # comfy-kitchen rotates activations in groups of a power of 4 (its regular Hadamard).
        return "int8" if int(params.get("group_size", 0)) in (4, 16, 64, 256, 1024) else None
    if scheme == "float":
        scale = parts.get("scale")
        per_tensor = scale is None or scale.numel() == 1
        fits = rows % 16 == 0 and cols % 16 == 0  # torch._scaled_mm's operand rule
        return "fp8" if parts["data"].dtype == torch.float8_e4m3fn and per_tensor and fits \
            else None
    if scheme == "mxfp8":
        return "mxfp8" if cols % 32 == 0 else None
    if scheme == "nvfp4":
        # Packed rows of K/2 bytes in multiples of 16 (K a multiple of 32), N in whole tiles.
        return "nvfp4" if cols % 32 == 0 and rows % 16 == 0 else None
    return None


def compute_path(weight, x_dtype: torch.dtype, device: torch.device, precision: str) -> str:
    """The path a linear layer with packed ``weight`` takes for activations of ``x_dtype`` on
    ``device``: ``weights`` (dequantise) or a low-precision path of the table above."""
    if precision == WEIGHTS or not kitchen_installed():
        return WEIGHTS
    path = weight_path(weight.scheme, weight.parts, tuple(weight.shape), weight.params)
    if path is None or (path != "int8" and x_dtype not in _HALF_FLOATS):
        return WEIGHTS
    found = device_capability(device)
    return path if found is not None and found >= MIN_CAPABILITY[path] else WEIGHTS
