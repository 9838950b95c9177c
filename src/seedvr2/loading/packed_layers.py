"""Linear and convolution layers whose weight stays packed on the device: dequantised per
forward in the module's ``compute_dtype``, or multiplied in the weights' own precision
(``loading.lowp``). :func:`attach_packed_weight` gives the module a ``weight`` property, so the
models are not touched (docs/models.md, "Quantised weights in memory")."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch
from torch import nn

from ..options import OptionError
from ..errors import UsageError
from .lowp import COMPUTE_PRECISIONS, WEIGHTS, compute_path, low_precision_linear
from .packed import PackedWeight, dtype_name

log = logging.getLogger("seedvr2")

_PART_PREFIX = "weight_"  # a packed part's buffer: weight_data, weight_scale, ...


# Errors a dequantised layer would not cure: out of memory, and a CUDA error that poisons the
# context (an illegal address is sticky; every later call fails, often in another layer).
# Older torch (some ComfyUI installs) has no torch.AcceleratorError: a plain RuntimeError.
_NOT_THE_KERNELS = (torch.OutOfMemoryError,
                    *filter(None, [getattr(torch, "AcceleratorError", None)]))


class PackedWeightMixin:
    """Mixed into a module's own class by :func:`attach_packed_weight` (see the module doc)."""

    _packed_layout: PackedWeight  # scheme, shape and params (its parts are the buffers)
    _packed_parts: tuple[str, ...]
    _packed_name: str  # the module's name in its model, for messages
    compute_dtype: torch.dtype
    compute_precision: str  # loading.lowp's option: auto or weights
    _lowp_failure: str | None  # why the low-precision product failed in this job (None: it did not)

    @property
    def packed_weight(self) -> PackedWeight:
        parts = {name: self._buffers[_PART_PREFIX + name] for name in self._packed_parts}
        return replace(self._packed_layout, parts=parts)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed_weight.dequantize(self.compute_dtype)

    def forward(self, x, *args, **kwargs):
        if isinstance(self, nn.Linear) and self._lowp_failure is None:
            packed = self.packed_weight
            path = compute_path(packed, x.dtype, x.device, self.compute_precision)
            if path != WEIGHTS:
                try:
                    return low_precision_linear(x, packed, self.bias)
                except _NOT_THE_KERNELS:
                    raise
                except Exception as error:  # noqa: BLE001 -- any kernel failure: dequantise
                    self._fall_back(path, packed, error)
        return super().forward(x, *args, **kwargs)

    def _fall_back(self, path: str, packed: PackedWeight, error: Exception):
        """A product that failed (an assertion of a kernel, a cuBLAS error, a call comfy-kitchen
        declines) is not retried: this layer dequantises until the next job's
        :func:`set_compute_precision`, and says so once."""
        detail = str(error).splitlines()[0][:300] if str(error) else ""
        self._lowp_failure = f"{type(error).__name__}{': ' if detail else ''}{detail}"
        log.warning("%s (%s weights): the %s low-precision product failed (%s); this layer "
                    "dequantises to %s for the rest of the job", self._packed_name, packed.label,
                    path, self._lowp_failure, dtype_name(self.compute_dtype))

    def _apply(self, fn, recurse=True):
        # Packed tensors keep their storage dtype: fn sees their bytes (a uint8 view, which
        # .to(dtype)/.half() leave alone); the dtype fn gives a float becomes the compute dtype.
        names = [_PART_PREFIX + n for n in self._packed_parts]
        packed = {n: self._buffers.pop(n) for n in names}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, tensor in packed.items():
                self._buffers[name] = _apply_to_bytes(fn, tensor)
        probe = fn(torch.empty(0, dtype=self.compute_dtype))
        if probe.is_floating_point():
            self.compute_dtype = probe.dtype
        return self

    def extra_repr(self) -> str:
        base = super().extra_repr()
        label = self.packed_weight.label
        return f"{base}, packed={label}, compute_dtype={dtype_name(self.compute_dtype)}"


def _apply_to_bytes(fn, tensor: torch.Tensor) -> torch.Tensor:
    moved = fn(tensor.reshape(-1).view(torch.uint8))
    return moved.view(tensor.dtype).reshape(tensor.shape)


@functools.cache
def _packed_class(base: type) -> type:
    # One subclass per module class, created once so that every packed Linear has the same type.
    return type(f"Packed{base.__name__}", (PackedWeightMixin, base), {"__module__": __name__})


PACKABLE_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def can_pack(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` can stay packed (the weight of a linear or convolution)."""
    return name == "weight" and isinstance(module, PACKABLE_MODULES)


def attach_packed_weight(module: nn.Module, packed: PackedWeight, compute_dtype: torch.dtype,
                         name: str = ""):
    """Make ``module.weight`` the dequantisation of ``packed`` (in ``compute_dtype``);
    ``name``, the module's name in its model, names it in messages."""
    if not can_pack(module, "weight"):
        raise UsageError(f"{type(module).__name__} cannot hold a packed weight")
    if not isinstance(module, PackedWeightMixin):
        module.__class__ = _packed_class(type(module))
    module._parameters.pop("weight", None)
    for part in getattr(module, "_packed_parts", ()):
        module._buffers.pop(_PART_PREFIX + part, None)
    for part, tensor in packed.parts.items():
        module._buffers[_PART_PREFIX + part] = tensor.contiguous()
    module._packed_layout = PackedWeight(packed.scheme, tuple(packed.shape), {},
                                         dict(packed.params))
    module._packed_parts = tuple(packed.parts)
    module._packed_name = name or getattr(module, "_packed_name", "") or type(module).__name__
    module.compute_dtype = compute_dtype
    module.compute_precision = getattr(module, "compute_precision", WEIGHTS)
    module._lowp_failure = None


def set_compute_precision(model: nn.Module, precision: str):
    """How ``model``'s packed linear layers multiply from now on (``compute_precision``, per
    run like the attention backend, so a cached model runs with each job's); a layer whose
    product failed in an earlier job tries it again."""
    if precision not in COMPUTE_PRECISIONS:
        raise OptionError(f"compute_precision {precision!r}: expected one of "
                          f"{', '.join(COMPUTE_PRECISIONS)}")
    for module in model.modules():
        if isinstance(module, PackedWeightMixin):
            module.compute_precision = precision
            module._lowp_failure = None


def packed_modules(model: nn.Module) -> dict[str, PackedWeight]:
    """Every packed weight of ``model`` by module name."""
    return {name: m.packed_weight for name, m in model.named_modules()
            if isinstance(m, PackedWeightMixin)}
