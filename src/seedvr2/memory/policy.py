"""Device and compute-precision choice, made in one place for every model and phase."""

from __future__ import annotations

import torch

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``auto`` = the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available on this machine; use cpu")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        device = torch.device("cuda", index)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on GPUs that support it, fp16 on other GPUs, fp32 on the CPU."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_offload(name: str) -> torch.device | None:
    """``none`` = no offloading; otherwise a device (checked like a compute device)."""
    return None if name == "none" else resolve_device(name)
