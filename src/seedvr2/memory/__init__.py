"""Where tensors live and in what precision: the one device/precision policy."""

from .policy import resolve_device, resolve_dtype

__all__ = ["resolve_device", "resolve_dtype"]
