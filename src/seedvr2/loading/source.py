"""What every file format's reader returns (:class:`TensorSource`) and raises
(:class:`CheckpointError`). The bottom of ``loading/``: imports ``errors`` only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import SeedVR2Error


class CheckpointError(SeedVR2Error, ValueError):
    """A weight file that cannot be loaded; the message names the file and what was expected."""


# ComfyUI prefixes diffusion-model keys in some files (and GGUF conversions keep it).
COMFY_PREFIX = "model.diffusion_model."


@dataclass
class TensorSource:
    """One weight file's tensors: shapes/dtypes up front, data on request (mmap where possible)
    through its reader's functions: ``get(key)``, the tensor as a plain float (packed weights
    dequantised to fp32); ``get_packed(key)``, a packed weight (``key in packed``) as a
    :class:`~.packed.PackedWeight`; ``close()``."""

    path: Path
    format: str  # "safetensors", "pickle" or "gguf"
    shapes: dict[str, tuple[int, ...]]  # logical shapes (what the model's tensors have)
    dtypes: dict[str, torch.dtype]
    metadata: dict[str, str] = field(default_factory=dict)
    # Weights stored quantised (GGUF blocks, fp8, int8, ...): key -> storage label ("Q4_K").
    packed: dict[str, str] = field(default_factory=dict)
    # A packed weight's stored tensors by role, for messages: key -> {part: file key}.
    part_keys: dict[str, dict[str, str]] = field(default_factory=dict)
    get: Callable[[str], torch.Tensor] = None
    get_packed: Callable[[str], object] = None
    close: Callable[[], None] = lambda: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def metadata_config(self) -> dict | None:
        """The JSON ``config`` metadata entry (our own files and re-saved conformance files)."""
        raw = self.metadata.get("config")
        if raw is None:
            return None
        try:
            config = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as e:
            detail = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise CheckpointError(f"{self.path}: metadata entry 'config' is not valid JSON "
                                  f"({detail})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{self.path}: metadata entry 'config' must be a JSON object")
        inner = config.get("constructor_kwargs", config)
        if not isinstance(inner, dict):
            raise CheckpointError(f"{self.path}: metadata entry 'config': constructor_kwargs "
                                  f"must be a JSON object")
        return inner


# CPU kernels choose code paths by operand alignment: a matrix-vector product with an 8-byte
# aligned weight differs in the last bit from one with a 64-byte aligned weight. PyTorch
# allocates 64-byte aligned (the offload arena 512), mmap'ed file tensors sit anywhere: copying
# misaligned ones makes results independent of the file's layout and of weight placement.
ALIGNMENT = 64


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied to PyTorch-allocated memory when its data is not 64-byte aligned."""
    if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % ALIGNMENT:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor
