"""Weights kept in their storage format on the device and dequantised per layer at forward time.

A :class:`PackedWeight` holds a weight as a file stores it (packed tensors, scheme, logical
shape); :func:`attach_packed_weight` gives a linear or convolution a ``weight`` property that
dequantises it in the module's ``compute_dtype``, so the models are not touched. Storage
schemes and how files declare them (:func:`scan_safetensors_layout`): docs/models.md,
"Quantised weights in memory"; multiplying in the weights' own precision: ``loading.lowp``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from ..errors import SeedVR2Error
from ..memory.compute_path import COMPUTE_PRECISIONS, WEIGHTS, compute_path


@dataclass(frozen=True)
class PackedWeight:
    """One weight in its storage format.

    ``shape`` is the logical (torch) shape the weight dequantises to; ``parts`` the stored
    tensors by role (``data``, ``scale``, ``scale_2``, ``blocks``); ``params`` the static
    parameters of the scheme (``qtype`` for GGUF, ``group_size`` for ConvRot).
    """

    scheme: str
    shape: tuple[int, ...]
    parts: Mapping[str, torch.Tensor]
    params: Mapping[str, object] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Short name of the storage format, e.g. ``Q4_K``, ``float8_e4m3fn``, ``int8_rows``."""
        if self.scheme == "gguf":
            return str(self.params["qtype"])
        if self.scheme == "float":
            dtype = str(self.parts["data"].dtype).replace("torch.", "")
            return dtype + ("_scaled" if "scale" in self.parts else "")
        return self.scheme

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    def to(self, device) -> "PackedWeight":
        """The same packed bytes on ``device`` (never a dtype change)."""
        parts = {k: v.to(device) for k, v in self.parts.items()}
        return PackedWeight(self.scheme, self.shape, parts, self.params)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight, of ``self.shape`` and ``dtype``, on the packed tensors' device."""
        return DEQUANTIZERS[self.scheme](self, dtype)


# ---------------------------------------------------------------------------------------------
# dequantisers (pure torch, vectorised, on the packed tensors' device)

def _dequantize_gguf(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    from .gguf import dequantize_blocks

    return dequantize_blocks(w.parts["blocks"], str(w.params["qtype"]), dtype).reshape(w.shape)


def _dequantize_float(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    data = w.parts["data"]
    scale = w.parts.get("scale")
    if scale is None:
        # fp8 e4m3fn/e5m2 values are exact in fp16, bf16 and fp32: one cast.
        return data.to(dtype).reshape(w.shape)
    return (data.to(torch.float32) * scale.to(torch.float32)).to(dtype).reshape(w.shape)


def _row_scale(scale: torch.Tensor, rows: int, ndim: int) -> torch.Tensor:
    """A per-tensor (numel 1) or per-output-channel scale, broadcastable over the weight."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(())
    return scale.reshape(rows, *([1] * (ndim - 1)))


def _dequantize_int8_rows(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    data = w.parts["data"]
    # int8 times fp32 promotes to fp32 in one kernel (int8 -> fp32 is exact).
    out = torch.mul(data, _row_scale(w.parts["scale"], data.shape[0], data.dim()))
    return out.to(dtype).reshape(w.shape)


@functools.lru_cache(maxsize=None)
def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table on ``device``, made once per (values, dtype, device).

    Built per call it was a host→device copy (which waits for the GPU stream) in every
    quantised layer of every forward. Kept for the process: a few bytes per table and device;
    never freed, so no stream can see its memory handed to another allocation. Made outside
    inference mode, so autograd may read it later.
    """
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def cached_hadamard(size: int, device: torch.device) -> torch.Tensor:
    """:func:`regular_hadamard` in float32 on ``device``, made once (size² · 4 bytes: 256 KB
    for the largest ConvRot group, 256)."""
    with torch.inference_mode(False):
        return regular_hadamard(size, device=device)


def regular_hadamard(size: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The normalised regular Hadamard matrix ``H4^{(x)k} / sqrt(size)`` (``size = 4^k``).

    ``H4 = [[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]]`` is symmetric with orthogonal rows, so
    the result is symmetric and orthonormal: it is its own inverse.
    """
    k, rest = 0, size
    while rest > 1 and rest % 4 == 0:
        rest, k = rest // 4, k + 1
    if rest != 1 or k == 0:
        raise ValueError(f"a regular Hadamard matrix needs a power of 4 as size, got {size}")
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]],
                      dtype=dtype, device=device)
    h = h4
    for _ in range(k - 1):
        h = torch.kron(h, h4)
    return h / (size ** 0.5)


def _dequantize_int8_convrot(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    data = w.parts["data"]
    rows, cols = data.shape
    group = int(w.params["group_size"])
    rotated = torch.mul(data, _row_scale(w.parts["scale"], rows, 2))
    # The file holds W·H (H per group of input channels); H is symmetric and orthonormal, so
    # (W·H)·H = W.
    h = cached_hadamard(group, data.device)
    out = torch.matmul(rotated.view(rows, cols // group, group), h)
    return out.reshape(w.shape).to(dtype)


def unswizzle_block_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """cuBLAS' block-scaling tile layout -> the plain ``(rows, cols)`` scale matrix.

    The stored matrix is ``(ceil(rows/128)·128, ceil(cols/4)·4)``; each 128x4 tile of the plain
    matrix is stored as 32 lines of 16, line ``r`` holding rows ``r, r+32, r+64, r+96`` (4
    scales each).
    """
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    tiles = blocked.reshape(row_tiles, col_tiles, 32, 4, 4)  # (rt, ct, r, quarter, col)
    plain = tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)
    return plain[:rows, :cols]


def swizzle_block_scales(plain: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unswizzle_block_scales` (pads with zeros); used to write test files."""
    rows, cols = plain.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = plain.new_zeros(row_tiles * 128, col_tiles * 4)
    padded[:rows, :cols] = plain
    tiles = padded.reshape(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(row_tiles * 128, col_tiles * 4)


def _dequantize_mxfp8(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    data = w.parts["data"]
    rows, cols = data.shape
    exponents = unswizzle_block_scales(w.parts["scale"].view(torch.uint8), rows, cols // 32)
    # E8M0: the byte is a biased fp32 exponent; 0 stands for a zero scale.
    scale = (exponents.to(torch.int32) << 23).view(torch.float32)
    scale = torch.where(exponents == 0, torch.zeros_like(scale), scale)
    out = data.to(torch.float32).view(rows, cols // 32, 32) * scale.unsqueeze(-1)
    return out.view(rows, cols)[: w.shape[0], : w.shape[1]].to(dtype)


E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest e2m1 value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _dequantize_nvfp4(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    packed = w.parts["data"]
    rows, half = packed.shape
    cols = 2 * half
    # Two E2M1 codes per byte, the first value in the high nibble.
    codes = torch.stack([packed >> 4, packed & 0x0F], dim=-1).view(-1)
    # int32 indices: half the bytes of int64 for a gather over every weight value.
    table = device_constant(E2M1_VALUES, torch.float32, packed.device)
    values = torch.index_select(table, 0, codes.to(torch.int32)).view(rows, cols)
    block = unswizzle_block_scales(w.parts["scale"].view(torch.float8_e4m3fn), rows, cols // 16)
    scale = block.to(torch.float32) * w.parts["scale_2"].to(torch.float32).reshape(())
    out = values.view(rows, cols // 16, 16) * scale.unsqueeze(-1)
    return out.view(rows, cols)[: w.shape[0], : w.shape[1]].to(dtype)


DEQUANTIZERS: dict[str, Callable[[PackedWeight, torch.dtype], torch.Tensor]] = {
    "gguf": _dequantize_gguf,
    "float": _dequantize_float,
    "int8_rows": _dequantize_int8_rows,
    "int8_convrot": _dequantize_int8_convrot,
    "mxfp8": _dequantize_mxfp8,
    "nvfp4": _dequantize_nvfp4,
}


# ---------------------------------------------------------------------------------------------
# modules whose weight stays packed

_PART_PREFIX = "weight_"


class PackedWeightMixin:
    """Mixed into a module's own class by :func:`attach_packed_weight` (see the module doc)."""

    _packed_scheme: str
    _packed_shape: tuple[int, ...]
    _packed_params: dict
    _packed_parts: tuple[str, ...]
    compute_dtype: torch.dtype
    compute_precision: str  # memory.compute_path's option: auto or weights

    @property
    def packed_weight(self) -> PackedWeight:
        parts = {name: self._buffers[_PART_PREFIX + name] for name in self._packed_parts}
        return PackedWeight(self._packed_scheme, self._packed_shape, parts, self._packed_params)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed_weight.dequantize(self.compute_dtype)

    def forward(self, x, *args, **kwargs):
        if isinstance(self, nn.Linear):
            packed = self.packed_weight
            path = compute_path(packed, x.dtype, x.device, self.compute_precision)
            if path != WEIGHTS:
                from .lowp import low_precision_linear

                out = low_precision_linear(path, x, packed, self.bias)
                if out is not None:
                    return out
        return super().forward(x, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        # Packed tensors keep their storage dtype: fn sees their bytes (a uint8 view, which
        # .to(dtype)/.half() leave alone) and device moves still apply. The dtype fn would give
        # a float tensor becomes the compute dtype.
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
        return f"{base}, packed={label}, compute_dtype={str(self.compute_dtype)[6:]}"


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


def attach_packed_weight(module: nn.Module, packed: PackedWeight, compute_dtype: torch.dtype):
    """Make ``module.weight`` the dequantisation of ``packed`` (in ``compute_dtype``)."""
    if not can_pack(module, "weight"):
        raise TypeError(f"{type(module).__name__} cannot hold a packed weight")
    if not isinstance(module, PackedWeightMixin):
        module.__class__ = _packed_class(type(module))
    module._parameters.pop("weight", None)
    for name in getattr(module, "_packed_parts", ()):
        module._buffers.pop(_PART_PREFIX + name, None)
    for name, tensor in packed.parts.items():
        module._buffers[_PART_PREFIX + name] = tensor.contiguous()
    module._packed_scheme = packed.scheme
    module._packed_shape = tuple(packed.shape)
    module._packed_params = dict(packed.params)
    module._packed_parts = tuple(packed.parts)
    module.compute_dtype = compute_dtype
    module.compute_precision = getattr(module, "compute_precision", WEIGHTS)


def set_compute_precision(model: nn.Module, precision: str):
    """How ``model``'s packed linear layers multiply from now on (``compute_precision``:
    ``auto`` or ``weights``, see ``memory.compute_path``); a per-run setting, like the
    attention backend, so a cached model runs with each job's."""
    if precision not in COMPUTE_PRECISIONS:
        raise ValueError(f"compute_precision {precision!r}: expected one of "
                         f"{', '.join(COMPUTE_PRECISIONS)}")
    for module in model.modules():
        if isinstance(module, PackedWeightMixin):
            module.compute_precision = precision


def packed_modules(model: nn.Module) -> dict[str, PackedWeight]:
    """Every packed weight of ``model`` by module name."""
    return {name: m.packed_weight for name, m in model.named_modules()
            if isinstance(m, PackedWeightMixin)}


# ---------------------------------------------------------------------------------------------
# safetensors layouts


class LayoutError(SeedVR2Error, ValueError):
    """A quantised layout that cannot be read; the caller adds the file name."""


@dataclass(frozen=True)
class PackedEntry:
    """Where a packed weight's parts are in a file, before reading them."""

    scheme: str
    shape: tuple[int, ...]
    files: Mapping[str, str]  # part -> file key
    views: Mapping[str, torch.dtype] = field(default_factory=dict)  # part -> dtype to view as
    params: Mapping[str, object] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.scheme == "float":
            return str(self.views.get("data", "fp8")).replace("torch.", "") + \
                ("_scaled" if "scale" in self.files else "")
        if self.scheme == "gguf":
            return str(self.params["qtype"])
        return self.scheme

    def read(self, get: Callable[[str], torch.Tensor]) -> PackedWeight:
        parts = {}
        for part, key in self.files.items():
            tensor = get(key)
            view = self.views.get(part)
            if view is not None and tensor.dtype != view:
                tensor = tensor.view(view)
            parts[part] = tensor
        return PackedWeight(self.scheme, self.shape, parts, self.params)


# Sibling tensors of a quantised layer that belong to its weight (or to activation
# quantisation, which weight-only dequantisation ignores).
_AUX_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale",
                 "comfy_quant", "scale_weight", "scale_input")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_COMFY_FLOAT_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _layer_configs(shapes, metadata, read_bytes) -> dict[str, dict]:
    """Per-layer ComfyUI quantisation configs: ``.comfy_quant`` tensors, then metadata."""
    configs: dict[str, dict] = {}
    raw = metadata.get("_quantization_metadata")
    if raw:
        try:
            layers = json.loads(raw).get("layers", {})
        except (json.JSONDecodeError, AttributeError) as e:
            raise LayoutError(f"metadata entry '_quantization_metadata' is not valid JSON ({e})")
        configs.update({k: v for k, v in layers.items() if isinstance(v, dict)})
    for key in shapes:
        if key.endswith(".comfy_quant"):
            layer = key[: -len(".comfy_quant")]
            try:
                conf = json.loads(read_bytes(key).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise LayoutError(f"tensor {key!r} is not a JSON quantisation config ({e})")
            if not isinstance(conf, dict) or "format" not in conf:
                raise LayoutError(f"tensor {key!r} has no 'format' entry")
            configs[layer] = conf
    return configs


def _conf(conf: dict, name: str, default):
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    return conf.get(name, params.get(name, default))


def _comfy_entry(layer: str, conf: dict, shapes) -> PackedEntry:
    fmt = conf["format"]
    key = f"{layer}.weight"
    if key not in shapes:
        raise LayoutError(f"layer {layer!r} is marked {fmt} but has no tensor {key!r}")
    shape = tuple(shapes[key])

    def need(suffix: str) -> str:
        name = f"{layer}.{suffix}"
        if name not in shapes:
            raise LayoutError(f"layer {layer!r} is marked {fmt} but has no tensor {name!r}")
        return name

    def optional(suffix: str) -> dict[str, str]:
        name = f"{layer}.{suffix}"
        return {"scale": name} if name in shapes else {}

    if fmt in _COMFY_FLOAT_FORMATS:
        return PackedEntry("float", shape, {"data": key, **optional("weight_scale")},
                           {"data": _COMFY_FLOAT_FORMATS[fmt]})
    if fmt == "int8_tensorwise":
        files = {"data": key, "scale": need("weight_scale")}
        if _conf(conf, "convrot", False):
            group = int(_conf(conf, "convrot_groupsize", 256))
            if len(shape) != 2 or shape[1] % group:
                raise LayoutError(f"layer {layer!r}: ConvRot groups of {group} do not divide "
                                  f"its weight of shape {list(shape)}")
            return PackedEntry("int8_convrot", shape, files, {"data": torch.int8},
                               {"group_size": group})
        return PackedEntry("int8_rows", shape, files, {"data": torch.int8})
    if fmt == "mxfp8":
        if len(shape) != 2 or shape[1] % 32:
            raise LayoutError(f"layer {layer!r}: mxfp8 weight of shape {list(shape)} is not "
                              f"(rows, 32·k)")
        return PackedEntry("mxfp8", shape, {"data": key, "scale": need("weight_scale")},
                           {"data": torch.float8_e4m3fn, "scale": torch.uint8})
    if fmt == "nvfp4":
        if len(shape) != 2 or (2 * shape[1]) % 16:
            raise LayoutError(f"layer {layer!r}: nvfp4 weight of shape {list(shape)} is not "
                              f"(rows, 8·k) packed bytes")
        return PackedEntry("nvfp4", (shape[0], 2 * shape[1]),
                           {"data": key, "scale": need("weight_scale"),
                            "scale_2": need("weight_scale_2")},
                           {"data": torch.uint8, "scale": torch.float8_e4m3fn})
    raise LayoutError(f"layer {layer!r} uses the quantisation format {fmt!r}, which this loader "
                      f"cannot dequantise (supported: float8_e4m3fn, float8_e5m2, "
                      f"int8_tensorwise with or without convrot, mxfp8, nvfp4)")


@dataclass
class SafetensorsLayout:
    """The model-facing view of a safetensors header with quantised layers folded in."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    packed: dict[str, PackedEntry]


def scan_safetensors_layout(shapes: Mapping[str, tuple], dtypes: Mapping[str, torch.dtype],
                            metadata: Mapping[str, str],
                            read_bytes: Callable[[str], bytes]) -> SafetensorsLayout:
    """Fold each quantised weight's sibling tensors (scales, configs) into one packed entry.

    ``read_bytes(key)`` returns a small tensor's raw bytes (the ``comfy_quant`` configs).
    """
    configs = _layer_configs(shapes, metadata, read_bytes)
    packed: dict[str, PackedEntry] = {}
    for layer, conf in configs.items():
        packed[f"{layer}.weight"] = _comfy_entry(layer, conf, shapes)
    for key, dtype in dtypes.items():
        if key in packed or not key.endswith(".weight") or len(shapes[key]) < 2:
            continue
        layer = key[: -len(".weight")]
        scale = next((f"{layer}.{s}" for s in ("weight_scale", "scale_weight")
                      if f"{layer}.{s}" in shapes), None)
        if dtype in _FP8:
            files = {"data": key, **({"scale": scale} if scale else {})}
            packed[key] = PackedEntry("float", tuple(shapes[key]), files, {"data": dtype})
        elif dtype == torch.int8 and scale is not None:
            packed[key] = PackedEntry("int8_rows", tuple(shapes[key]),
                                      {"data": key, "scale": scale}, {"data": torch.int8})
    aux = {f"{key[: -len('.weight')]}.{s}" for key in packed for s in _AUX_SUFFIXES}
    aux |= {f"{layer}.comfy_quant" for layer in configs}
    aux.add("scaled_fp8")  # legacy marker tensor of ComfyUI "scaled fp8" files
    model_shapes = {k: tuple(v) for k, v in shapes.items() if k not in aux}
    model_dtypes = {k: v for k, v in dtypes.items() if k not in aux}
    for key, entry in packed.items():
        model_shapes[key] = entry.shape
    return SafetensorsLayout(model_shapes, model_dtypes, packed)
