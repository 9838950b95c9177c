"""Weights kept in their storage format (:class:`PackedWeight`, dequantised in pure torch
wherever its tensors live), and :data:`FORMATS`, the one table of storage formats, into which
each format module registers its row (docs/models.md, "Quantised weights in memory").
Imports ``errors`` only: the format modules import this one, never the reverse."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from ..errors import SeedVR2Error


class LayoutError(SeedVR2Error, ValueError):
    """A quantised layout that cannot be read; the caller adds the file name."""


@dataclass(frozen=True)
class PackedWeight:
    """One weight in its storage format: ``shape``, the logical shape it dequantises to;
    ``parts``, the stored tensors by role (``data``, ``scale``, ``scale_2``, ``blocks``);
    ``params``, the scheme's static parameters (``qtype`` for GGUF, ``group_size`` for ConvRot)."""

    scheme: str
    shape: tuple[int, ...]
    parts: Mapping[str, torch.Tensor]
    params: Mapping[str, object] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Short name of the storage format, e.g. ``Q4_K``, ``float8_e4m3fn``, ``int8_rows``."""
        return scheme_of(self.scheme).label(self.params, {k: v.dtype for k, v in
                                                          self.parts.items()})

    def to(self, device) -> "PackedWeight":
        """The same packed bytes on ``device`` (never a dtype change)."""
        parts = {k: v.to(device) for k, v in self.parts.items()}
        return PackedWeight(self.scheme, self.shape, parts, self.params)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight, of ``self.shape`` and ``dtype``, on the packed tensors' device."""
        return scheme_of(self.scheme).dequantize(self, dtype)

    def non_finite_part(self) -> Optional[str]:
        """The first part holding NaN or infinite values (one flag read back per part), or
        None. Codes that cannot be non-finite (int8, e2m1 pairs) are not read."""
        scheme = scheme_of(self.scheme)
        for name, tensor in self.parts.items():
            rule = scheme.parts.get(name)
            detect = rule.non_finite if rule is not None else None
            if detect is not None and tensor.numel() and bool(detect(tensor, self.params).any()):
                return name
        return None


@dataclass(frozen=True)
class PackedEntry:
    """Where a packed weight's parts are in a file, before reading them."""

    scheme: str
    shape: tuple[int, ...]
    files: Mapping[str, str]  # part -> file key
    views: Mapping[str, torch.dtype] = field(default_factory=dict)  # part -> dtype to view as
    params: Mapping[str, object] = field(default_factory=dict)
    marker: str = ""  # the comfy_quant format that declared it ("" when its dtypes did)

    def label(self, stored: Mapping[str, torch.dtype]) -> str:
        dtypes = {part: self.views.get(part, stored[key]) for part, key in self.files.items()}
        return scheme_of(self.scheme).label(self.params, dtypes)

    def read(self, get: Callable[[str], torch.Tensor]) -> PackedWeight:
        parts = {}
        for part, key in self.files.items():
            tensor = get(key)
            view = self.views.get(part)
            if view is not None and tensor.dtype != view:
                tensor = tensor.view(view)
            parts[part] = tensor
        return PackedWeight(self.scheme, self.shape, parts, self.params)


# ---------------------------------------------------------------------------------------------
# the table


def non_finite_values(tensor: torch.Tensor, params: Mapping = None) -> torch.Tensor:  # noqa: ARG001
    """A bool tensor: where ``tensor``'s values are NaN or infinite, by its dtype's encoding
    (the fp8 formats by their bit patterns; torch has no isfinite for them everywhere)."""
    dtype = tensor.dtype
    if dtype == torch.float8_e4m3fn:
        return (tensor.view(torch.uint8) & 0x7F) == 0x7F
    if dtype == torch.float8_e5m2:
        return (tensor.view(torch.uint8) & 0x7C) == 0x7C
    if dtype == torch.float8_e8m0fnu:
        return tensor.view(torch.uint8) == 0xFF
    if dtype.is_floating_point:
        return ~torch.isfinite(tensor)
    return torch.zeros((), dtype=torch.bool, device=tensor.device)


@dataclass(frozen=True)
class Part:
    """One stored tensor of a scheme: the dtypes a file may store it in (the first is what
    ``seedvr2 quantize`` writes), the shapes it may have for a weight of a given logical shape
    and parameters, and how its NaN/inf values are found (None: codes that cannot be)."""

    dtypes: tuple[torch.dtype, ...]
    shapes: Callable[[tuple[int, ...], Mapping], list[tuple[int, ...]]]
    optional: bool = False
    non_finite: Optional[Callable[[torch.Tensor, Mapping], torch.Tensor]] = non_finite_values

    def problem(self, dtype: torch.dtype, shape: tuple[int, ...], logical: tuple[int, ...],
                params: Mapping) -> Optional[str]:
        allowed = [tuple(s) for s in self.shapes(logical, params)]
        if dtype in self.dtypes and tuple(shape) in allowed:
            return None
        dtypes = " or ".join(dtype_name(d) for d in self.dtypes)
        shapes = " or ".join(str(list(s)) for s in allowed)
        return f"expected {dtypes} of shape {shapes}; found {dtype_name(dtype)} {list(shape)}"


def dtype_name(dtype: torch.dtype) -> str:
    """``float8_e4m3fn`` for ``torch.float8_e4m3fn``: a dtype as messages and labels name it."""
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Product:
    """A scheme's low-precision product (``loading.lowp``): the compute ``path`` it is reported
    as, the ``kernels`` it calls (keys of ``seedvr2.kernels.KERNELS``, whose rules gate it), why
    a 2-D weight's layout does not fit them (``fits``: None when it does), and ``run``."""

    path: str
    kernels: tuple[str, ...]
    fits: Callable[["PackedWeight"], Optional[str]]
    run: Callable[..., torch.Tensor]
    half_activations: bool = True  # the float paths quantise fp16/bf16 activations only


@dataclass(frozen=True)
class Scheme:
    """How one storage scheme is stored (``parts``), dequantised, labelled and multiplied."""

    name: str
    parts: Mapping[str, Part]
    dequantize: Callable[[PackedWeight, torch.dtype], torch.Tensor]
    label: Callable[[Mapping, Mapping[str, torch.dtype]], str] = None
    product: Optional[Product] = None

    def __post_init__(self):
        if self.label is None:
            object.__setattr__(self, "label", lambda params, dtypes: self.name)


@dataclass(frozen=True)
class Target:
    """A ``seedvr2 quantize`` target written in a safetensors layout: ``layout(layer, shape)``
    gives the ``comfy_quant`` marker and the layer's tensors (file key -> (dtype, shape)), or
    None when the weight does not fit; ``encode(weight, marker)`` the tensors, in that order."""

    name: str
    layout: Callable[[str, tuple[int, ...]], Optional[tuple[dict, dict]]]
    encode: Callable[[torch.Tensor, dict], list[torch.Tensor]]


# A marker reader: (layer, comfy_quant config, shapes, dtypes) -> the layer's PackedEntry.
MarkerReader = Callable[[str, Mapping[str, Any], Mapping, Mapping], PackedEntry]
# A dtype reader, for layouts told by dtypes alone (plain fp8, int8 + weight_scale):
# (weight key, shapes, dtypes) -> PackedEntry or None.
DtypeReader = Callable[[str, Mapping, Mapping], Optional[PackedEntry]]


@dataclass(frozen=True)
class Format:
    """A format module's row of :data:`FORMATS`: its schemes, the ``comfy_quant`` formats it
    reads, the layouts it recognises by dtypes alone, and the quantize targets it writes."""

    name: str
    schemes: tuple[Scheme, ...]
    markers: Mapping[str, MarkerReader] = field(default_factory=dict)
    by_dtype: Optional[DtypeReader] = None
    targets: tuple[Target, ...] = ()
    # Bytes per weight of each label and target name, block scales included (for memory and sizes).
    bytes_per_weight: Mapping[str, float] = field(default_factory=dict)


FORMATS: dict[str, Format] = {}
# Indexes of FORMATS, kept by register().
SCHEMES: dict[str, Scheme] = {}
MARKERS: dict[str, MarkerReader] = {}
TARGETS: dict[str, Target] = {}


def register(fmt: Format) -> Format:
    """Add a format module's row (at its import; once per name)."""
    FORMATS[fmt.name] = fmt
    for scheme in fmt.schemes:
        SCHEMES[scheme.name] = scheme
    MARKERS.update(fmt.markers)
    for target in fmt.targets:
        TARGETS[target.name] = target
    return fmt


PLAIN_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def bytes_per_weight(label: str) -> Optional[float]:
    """Bytes per weight of a storage format's label or target (a plain dtype's name too), or
    None when no row of :data:`FORMATS` names it."""
    found = [fmt.bytes_per_weight[label] for fmt in FORMATS.values()
             if label in fmt.bytes_per_weight]
    return found[0] if found else PLAIN_BYTES.get(label)


def scheme_of(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise LayoutError(f"unknown storage scheme {name!r} (known: {', '.join(SCHEMES)}); "
                          f"import seedvr2.loading.format_table to register them all") from None


def entry_problem(entry: PackedEntry, shapes: Mapping, dtypes: Mapping) -> Optional[str]:
    """What is wrong with the stored tensors of ``entry`` by the header alone (each part's
    dtype and shape against its scheme's rules), naming the tensor; or None."""
    scheme = scheme_of(entry.scheme)
    if len(entry.shape) < 2 or 0 in entry.shape:
        first = next(iter(entry.files.values()))
        return f"tensor {first!r}: expected a weight of at least 2 non-zero dimensions " \
               f"({entry.scheme}); found {list(entry.shape)}"
    for name, rule in scheme.parts.items():
        key = entry.files.get(name)
        if key is None or key not in shapes:
            if not rule.optional:
                first = next(iter(entry.files.values()))
                layer = first[: -len(".weight")] if first.endswith(".weight") else first
                how = f"marked {entry.marker}" if entry.marker else f"stored as {entry.scheme}"
                return f"layer {layer!r} is {how} but has no tensor {key or name!r}"
            continue
        problem = rule.problem(dtypes[key], tuple(shapes[key]), tuple(entry.shape),
                               entry.params)
        if problem:
            return f"tensor {key!r}: {problem} ({entry.scheme})"
    return None


# ---------------------------------------------------------------------------------------------
# shared by the formats


@functools.lru_cache(maxsize=None)
def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table on ``device``, made once per (values, dtype, device): built per
    call it was a host→device copy (which waits for the GPU stream) in every quantised layer of
    every forward. Never freed (a few bytes), so no stream sees its memory handed to another
    allocation; made outside inference mode, so autograd may read it later."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=dtype, device=device)


FLOAT_SCALES = (torch.float32, torch.float16, torch.bfloat16)  # what a multiplying scale may be


def row_scale_shapes(shape: tuple[int, ...], params: Mapping = None) -> list[tuple[int, ...]]:  # noqa: ARG001
    """A per-tensor or per-output-channel scale of a weight of ``shape``."""
    rows = shape[0]
    return [(), (1,), (rows,), (rows, 1)]


def row_scale(scale: torch.Tensor, rows: int, ndim: int) -> torch.Tensor:
    """A per-tensor (numel 1) or per-output-channel scale, broadcastable over the weight."""
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(())
    return scale.reshape(rows, *([1] * (ndim - 1)))


def unswizzle_block_scales(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """cuBLAS' block-scaling tile layout -> the plain ``(rows, cols)`` scale matrix. The stored
    matrix is ``(ceil(rows/128)·128, ceil(cols/4)·4)``; each 128x4 tile of the plain matrix is 32
    lines of 16, line ``r`` holding rows ``r, r+32, r+64, r+96`` (4 scales each)."""
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    tiles = blocked.reshape(row_tiles, col_tiles, 32, 4, 4)  # (rt, ct, r, quarter, col)
    plain = tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)
    return plain[:rows, :cols]


def swizzle_block_scales(plain: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unswizzle_block_scales` (pads with zeros)."""
    rows, cols = plain.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = plain.new_zeros(row_tiles * 128, col_tiles * 4)
    padded[:rows, :cols] = plain
    tiles = padded.reshape(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(row_tiles * 128, col_tiles * 4)


E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def block_scaled_weight(layer: str, shapes: Mapping, divisor: int,
                        expected: str) -> tuple[str, tuple[int, ...]]:
    """The key and stored shape of a block-scaled layer's weight: 2-D, its columns a multiple
    of ``divisor``; else a :class:`LayoutError` saying what was ``expected``."""
    key = f"{layer}.weight"
    shape = tuple(shapes[key])
    if len(shape) != 2 or shape[1] % divisor:
        raise LayoutError(f"tensor {key!r}: expected {expected}; found {list(shape)}")
    return key, shape


def conf_value(conf: Mapping, name: str, default):
    """A ``comfy_quant`` parameter, at the top level or under ``params`` (ComfyUI reads both)."""
    params = conf.get("params") if isinstance(conf.get("params"), Mapping) else {}
    return conf.get(name, params.get(name, default))
