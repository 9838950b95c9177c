"""Device and compute-precision choice, made in one place for every model and phase."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import kernels
from ..errors import SeedVR2Error
from ..options import OptionError

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``auto`` = the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"device {name!r}: CUDA is not available on this machine; use cpu")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise OptionError(f"device {name!r}: only {torch.cuda.device_count()} CUDA "
                              f"device(s) here")
        device = torch.device("cuda", index)
    return device


# bf16 runs natively from compute capability 8.0 (Ampere). torch.cuda.is_bf16_supported()
# also says yes on 7.x (T4, V100, RTX 20xx), where bf16 is emulated and several times slower.
NATIVE_BF16_CAPABILITY = (8, 0)
# On AMD, the gfx architectures with bf16 matrix instructions: CDNA (MI100 gfx908, MI200
# gfx90a, MI300 gfx94x, MI350 gfx950) and RDNA3 on (gfx11, gfx12). ROCm's capability is the gfx
# number (gfx906, no bf16, says 9.0), not an NVIDIA generation.
ROCM_NATIVE_BF16 = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")


def native_bf16(device: torch.device) -> bool:
    if kernels.platform_of(device).kind == "rocm":
        return torch.cuda.get_device_properties(device).gcnArchName.startswith(ROCM_NATIVE_BF16)
    return torch.cuda.get_device_capability(device) >= NATIVE_BF16_CAPABILITY


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on GPUs with native bf16 (:func:`native_bf16`), fp16 on older GPUs (checked
    for overflow: :func:`check_finite`), fp32 on the CPU."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if native_bf16(device) else torch.float16
    return torch.float32


class NonFiniteError(SeedVR2Error, RuntimeError):
    """A phase produced NaN or infinite values (fp16 overflow); the message names the fix."""


def check_finite(values: torch.Tensor, phase: str, dtype: torch.dtype, batch: str = ""):
    """Raise :class:`NonFiniteError` when a phase's output for one batch holds NaN or inf,
    naming the phase, the batch and the likely cause (in fp16 its range; elsewhere a weight of
    extreme magnitude: files and frames are checked when read); one flag read back."""
    if values.device.type == "meta" or is_fake(values):
        return  # a traced run (placement, memory): no values to read
    if bool(torch.isfinite(values).all()):
        return
    stopped = f"; stopped at {batch}" if batch else ""
    if dtype == torch.float16:
        raise NonFiniteError(
            f"the {phase} produced NaN or infinite values in fp16 (its range ends at 65504): "
            f"set dtype to fp32 (--dtype fp32; or bf16 on a GPU of compute capability 8.0 or "
            f"newer, where dtype auto picks it){stopped}")
    raise NonFiniteError(
        f"the {phase} produced NaN or infinite values in {str(dtype).replace('torch.', '')}: "
        f"its weights hold finite values (checked at load), so the likely cause is a weight of "
        f"extreme magnitude (a hand-made or damaged quantised file: try the released weights) "
        f"or, with dtype fp16, an overflow{stopped}")


def resolve_offload(name: str) -> torch.device | None:
    """``none`` = no offloading; otherwise a device (checked like a compute device)."""
    return None if name == "none" else resolve_device(name)
