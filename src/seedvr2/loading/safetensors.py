"""safetensors files: the header checked as the safetensors library would check it, and each
quantised layer's tensors folded into one packed weight checked against its row of
``loading.packed.FORMATS`` (docs/models.md, "Quantised weights in memory")."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping

import torch

from . import format_table  # noqa: F401 -- every format registered: the table below is complete
from .packed import FORMATS, MARKERS, LayoutError, PackedEntry, entry_problem
from .source import COMFY_PREFIX, CheckpointError, TensorSource

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,  # MXFP8 block scales
}

def read_safetensors_header(path: Path) -> tuple[dict, dict, int]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets), metadata and
    the byte its tensor data starts at, checked so that a damaged or hostile header is one
    :class:`CheckpointError` naming the file (the library raises KeyError, TypeError or its own
    error without the file's name)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (its header runs past the "
                                  f"end of the file, {size} bytes)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{path}: corrupt safetensors header (JSON nested too deeply)") \
            from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: corrupt safetensors header (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON: {e.msg} at "
                              f"byte {e.pos})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON object was expected, "
                              f"not {type(header).__name__})")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or \
            not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ must map names "
                              f"to strings)")
    data_size = size - 8 - header_len
    spans = []
    for name, entry in header.items():
        problem = _tensor_entry_problem(entry)
        if problem:
            raise CheckpointError(f"{path}: corrupt safetensors header (tensor {name!r}: "
                                  f"{problem})")
        begin, end = entry["data_offsets"]
        need = math.prod(entry["shape"]) * SAFETENSORS_DTYPES[entry["dtype"]].itemsize
        if end - begin != need:
            raise CheckpointError(f"{path}: corrupt safetensors header (tensor {name!r}: shape "
                                  f"{entry['shape']} of {entry['dtype']} needs {need} bytes, its "
                                  f"data_offsets span {end - begin})")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise CheckpointError(f"{path}: corrupt safetensors header (tensor {name!r}: data "
                                  f"starts at byte {begin}, the previous tensor ends at "
                                  f"{position}; tensors must follow each other)")
        position = end
    if position > data_size:
        raise CheckpointError(f"{path}: truncated safetensors file (tensors need "
                              f"{8 + header_len + position} bytes, file has {size})")
    if position < data_size:
        raise CheckpointError(f"{path}: corrupt safetensors file ({data_size - position} bytes "
                              f"after the last tensor)")
    return header, metadata, 8 + header_len


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entry_problem(entry) -> str | None:
    """What is wrong with one tensor's header entry, or None."""
    if not isinstance(entry, dict):
        return f"an object with dtype, shape and data_offsets was expected, not " \
               f"{type(entry).__name__}"
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            return f"no {key}"
    if not isinstance(entry["dtype"], str):
        return "dtype is not a string"
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        return f"unsupported dtype {entry['dtype']!r}"
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return "shape must be a list of whole numbers of at least 0"
    offsets = entry["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or \
            not all(_is_count(o) for o in offsets):
        return "data_offsets must be two whole numbers of at least 0 (begin, end)"
    if offsets[1] < offsets[0]:
        return f"data_offsets end before they begin ({offsets[0]}, {offsets[1]})"
    return None


# A quantised layer's tensors beside its weight (activation quantisation's are ignored).
_AUX_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale",
                 "comfy_quant", "scale_weight", "scale_input")


def _json(raw: bytes | str, where: str):
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        detail = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else e.msg
        raise LayoutError(f"{where} is not a JSON quantisation config ({detail})") from None
    except RecursionError:
        raise LayoutError(f"{where} is not a JSON quantisation config (nested too deeply)") \
            from None


def _shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _layer_configs(shapes: Mapping, metadata: Mapping, read_bytes) -> dict[str, tuple[str, object]]:
    """Per-layer ComfyUI quantisation configs, ``layer -> (where it is declared, config)``:
    the ``_quantization_metadata`` entry's ``layers`` table, then ``.comfy_quant`` tensors."""
    configs: dict[str, tuple[str, object]] = {}
    raw = metadata.get("_quantization_metadata")
    if raw:
        where = "metadata entry '_quantization_metadata'"
        table = _json(raw, where)
        layers = table.get("layers", {}) if isinstance(table, dict) else table
        if not isinstance(layers, dict):
            raise LayoutError(f"{where}: expected an object whose 'layers' maps layer names to "
                              f"configs; found {_shown(layers)}")
        for layer, conf in layers.items():
            configs[layer] = (f"{where}, layer {layer!r}", conf)
    for key in shapes:
        if key.endswith(".comfy_quant"):
            configs[key[: -len(".comfy_quant")]] = (f"tensor {key!r}",
                                                    _json(read_bytes(key), f"tensor {key!r}"))
    return configs


def _marked_entry(layer: str, where: str, conf, shapes, dtypes) -> PackedEntry:
    fmt = conf.get("format") if isinstance(conf, dict) else None
    if not isinstance(fmt, str):
        raise LayoutError(f"{where}: expected a JSON object with a 'format' string; found "
                          f"{_shown(conf)}")
    if fmt not in MARKERS:
        raise LayoutError(f"layer {layer!r} uses the quantisation format {fmt!r}, which this "
                          f"loader cannot dequantise (supported: {', '.join(MARKERS)})")
    if f"{layer}.weight" not in shapes:
        raise LayoutError(f"layer {layer!r} is marked {fmt} but has no tensor "
                          f"{layer + '.weight'!r}")
    return replace(MARKERS[fmt](layer, conf, shapes, dtypes), marker=fmt)


@dataclass
class SafetensorsLayout:
    """The model-facing view of a safetensors header with quantised layers folded in."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    packed: dict[str, PackedEntry]


def scan_safetensors_layout(shapes: Mapping[str, tuple], dtypes: Mapping[str, torch.dtype],
                            metadata: Mapping[str, str],
                            read_bytes: Callable[[str], bytes]) -> SafetensorsLayout:
    """Fold each quantised weight's sibling tensors (scales, configs) into one packed entry,
    checked by :func:`~.packed.entry_problem`; ``read_bytes(key)`` gives a small tensor's raw
    bytes (the ``comfy_quant`` configs)."""
    configs = _layer_configs(shapes, metadata, read_bytes)
    packed: dict[str, PackedEntry] = {}
    for layer, (where, conf) in configs.items():
        packed[f"{layer}.weight"] = _marked_entry(layer, where, conf, shapes, dtypes)
    for key in dtypes:
        if key in packed or not key.endswith(".weight") or len(shapes[key]) < 2:
            continue
        for fmt in FORMATS.values():
            entry = fmt.by_dtype(key, shapes, dtypes) if fmt.by_dtype else None
            if entry is not None:
                packed[key] = entry
                break
    for entry in packed.values():
        problem = entry_problem(entry, shapes, dtypes)
        if problem:
            raise LayoutError(problem)
    aux = {f"{key[: -len('.weight')]}.{s}" for key in packed for s in _AUX_SUFFIXES}
    aux |= {f"{layer}.comfy_quant" for layer in configs}
    aux.add("scaled_fp8")  # legacy marker tensor of ComfyUI "scaled fp8" files
    model_shapes = {k: tuple(v) for k, v in shapes.items() if k not in aux}
    model_dtypes = {k: v for k, v in dtypes.items() if k not in aux}
    for key, entry in packed.items():
        model_shapes[key] = entry.shape
    return SafetensorsLayout(model_shapes, model_dtypes, packed)


def open_safetensors(path: Path) -> TensorSource:
    header, metadata, data_start = read_safetensors_header(path)
    from safetensors import safe_open

    # Keys as the model names them: a ComfyUI prefix is dropped when every key has it.
    prefix = COMFY_PREFIX if header and all(k.startswith(COMFY_PREFIX) for k in header) else ""
    file_key = {k[len(prefix):]: k for k in header}

    def read_bytes(key: str) -> bytes:
        begin, end = header[file_key[key]]["data_offsets"]
        with open(path, "rb") as f:
            f.seek(data_start + begin)
            return f.read(end - begin)

    try:
        layout = scan_safetensors_layout(
            {k: tuple(header[f]["shape"]) for k, f in file_key.items()},
            {k: SAFETENSORS_DTYPES[header[f]["dtype"]] for k, f in file_key.items()},
            metadata, read_bytes)
    except LayoutError as e:
        raise CheckpointError(f"{path}: {e}") from None
    handle = safe_open(str(path), framework="pt", device="cpu")
    read = lambda key: handle.get_tensor(file_key[key])  # noqa: E731

    def get(key: str) -> torch.Tensor:
        entry = layout.packed.get(key)
        return read(key) if entry is None else entry.read(read).dequantize(torch.float32)

    stored = {k: SAFETENSORS_DTYPES[header[f]["dtype"]] for k, f in file_key.items()}
    return TensorSource(
        path, "safetensors", shapes=layout.shapes, dtypes=layout.dtypes,
        metadata=dict(metadata), packed={k: e.label(stored) for k, e in layout.packed.items()},
        part_keys={k: dict(e.files) for k, e in layout.packed.items()},
        get=get, get_packed=lambda key: layout.packed[key].read(read),
        close=lambda: handle.__exit__(None, None, None))
