"""Weight files, opened lazily: keys, shapes and dtypes without reading tensor data. The format
is told by the first bytes, never the name; each reader (``safetensors``, ``gguf``, torch
pickles here) returns a :class:`~.source.TensorSource`."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from .gguf import open_gguf
from .safetensors import open_safetensors
from .source import CheckpointError, TensorSource

__all__ = ["CheckpointError", "open_weights", "sniff_format"]


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
        return open_safetensors(path)
    if fmt == "pickle":
        return _open_pickle(path)
    return open_gguf(path)


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
                        get=state.__getitem__, close=state.clear)
