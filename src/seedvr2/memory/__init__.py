"""Where tensors live and in what precision: devices, model cache, BlockSwap, torch.compile."""

from .cache import MODEL_CACHE, ModelCache, ModelKey
from .device_choice import resolve_device, resolve_dtype, resolve_offload

__all__ = ["MODEL_CACHE", "ModelCache", "ModelKey", "resolve_device", "resolve_dtype",
           "resolve_offload"]
