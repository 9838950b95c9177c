"""Weight files, opened lazily: keys, shapes and dtypes without reading tensor data.

The format is told by the file's first bytes, never by its name.
"""

from __future__ import annotations

import json
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import SeedVR2Error


class CheckpointError(SeedVR2Error, ValueError):
    """A weight file that cannot be loaded; the message names the file and what was expected."""


@dataclass
class TensorSource:
    """One weight file's tensors: shapes/dtypes up front, data on request (mmap where possible)."""

    path: Path
    format: str  # "safetensors", "pickle" or "gguf"
    shapes: dict[str, tuple[int, ...]]  # logical shapes (what the model's tensors have)
    dtypes: dict[str, torch.dtype]
    metadata: dict[str, str] = field(default_factory=dict)
    # Weights stored quantised (GGUF blocks, fp8, int8, ...): key -> storage label ("Q4_K").
    packed: dict[str, str] = field(default_factory=dict)
    _get: Callable[[str], torch.Tensor] | None = None
    _close: Callable[[], None] | None = None
    _get_packed: Callable[[str], object] | None = None

    def get(self, key: str) -> torch.Tensor:
        """The tensor as a plain float (packed weights dequantised to fp32)."""
        return self._get(key)

    def get_packed(self, key: str):
        """A packed weight (``key in self.packed``) as a :class:`~.quantized.PackedWeight`."""
        return self._get_packed(key)

    def close(self):
        if self._close:
            self._close()

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
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.path}: metadata entry 'config' is not valid JSON ({e})")
        if not isinstance(config, dict):
            raise CheckpointError(f"{self.path}: metadata entry 'config' must be a JSON object")
        return config.get("constructor_kwargs", config)


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,  # MXFP8 block scales
}

# ComfyUI prefixes diffusion-model keys in some files (and GGUF conversions keep it).
COMFY_PREFIX = "model.diffusion_model."


def sniff_format(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == b"GGUF":
        return "gguf"
    # Safetensors first: its first 8 bytes are the header's length, whose low byte is 0x80
    # (a pickle's first byte) for one header size in 256; no pickle has "{" at byte 8.
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "pickle"
    # The file's bytes are never quoted: a name from a workflow may point at any file.
    raise CheckpointError(f"{path}: unrecognised weight file (expected safetensors, a torch "
                          f".pth/.pt state dict, or GGUF)")


def open_weights(path) -> TensorSource:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    fmt = sniff_format(path)
    if fmt == "safetensors":
        return _open_safetensors(path)
    if fmt == "pickle":
        return _open_pickle(path)
    from .gguf import open_gguf

    return open_gguf(path)


def read_safetensors_header(path: Path) -> tuple[dict, dict]:
    """The tensor entries (name -> dtype, shape, data_offsets) and the metadata of a
    safetensors file, checked as the safetensors library would check them, so that a damaged or
    hostile header is one :class:`CheckpointError` naming the file and the problem (the
    library raises KeyError, TypeError or its own error without the file's name)."""
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
    return header, metadata


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


def _open_safetensors(path: Path) -> TensorSource:
    header, metadata = read_safetensors_header(path)
    from safetensors import safe_open

    from .quantized import LayoutError, scan_safetensors_layout

    handle = safe_open(str(path), framework="pt", device="cpu")
    # Keys as the model names them: a ComfyUI prefix is dropped when every key has it.
    prefix = COMFY_PREFIX if header and all(k.startswith(COMFY_PREFIX) for k in header) else ""
    file_key = {k[len(prefix):]: k for k in header}
    read = lambda key: handle.get_tensor(file_key[key])  # noqa: E731
    try:
        layout = scan_safetensors_layout(
            {k: tuple(header[f]["shape"]) for k, f in file_key.items()},
            {k: SAFETENSORS_DTYPES[header[f]["dtype"]] for k, f in file_key.items()},
            metadata, lambda key: read(key).numpy().tobytes())
    except LayoutError as e:
        handle.__exit__(None, None, None)
        raise CheckpointError(f"{path}: {e}") from None

    def get(key: str) -> torch.Tensor:
        entry = layout.packed.get(key)
        return read(key) if entry is None else entry.read(read).dequantize(torch.float32)

    return TensorSource(
        path, "safetensors", shapes=layout.shapes, dtypes=layout.dtypes,
        metadata=dict(metadata), packed={k: e.label for k, e in layout.packed.items()},
        _get=get, _get_packed=lambda key: layout.packed[key].read(read),
        _close=lambda: handle.__exit__(None, None, None))


def _open_pickle(path: Path) -> TensorSource:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True,
                           mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: this .pth needs code to unpickle, which is refused for "
                              f"safety (weights_only=True); save a plain state dict of tensors "
                              f"or convert it to safetensors. Detail: {str(e).splitlines()[0]}")
    except MemoryError:
        raise
    except Exception as e:
        # A damaged pickle raises whatever the unpickler trips on (IndexError, KeyError...);
        # only the archive reader's own messages are shown, never the file's bytes.
        detail = str(e).splitlines()[0] if isinstance(e, (RuntimeError, zipfile.BadZipFile)) \
            and str(e) else f"damaged data: {type(e).__name__}"
        raise CheckpointError(f"{path}: unreadable torch checkpoint ({detail})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensors (name -> tensor)")
    return TensorSource(path, "pickle",
                        shapes={k: tuple(v.shape) for k, v in state.items()},
                        dtypes={k: v.dtype for k, v in state.items()},
                        _get=state.__getitem__, _close=state.clear)


# CPU kernels choose code paths by operand alignment: a matrix-vector product with an 8-byte
# aligned weight differs in the last bit from the same product with a 64-byte aligned one.
# Tensors read from a file (mmap) sit wherever the file put them, while every tensor PyTorch
# allocates is 64-byte aligned (and the offload arena 512-byte aligned). Copying misaligned
# file tensors makes results independent of the file's layout and of where placement code
# moves the weights.
ALIGNMENT = 64


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied to PyTorch-allocated memory when its data is not 64-byte aligned."""
    if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % ALIGNMENT:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor
