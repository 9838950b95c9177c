"""Text embeddings for the DiT: SeedVR2 conditions on one fixed positive prompt embedding. The
official download ships ``pos_emb.pt`` (58 x 5120) and ``neg_emb.pt``; with guidance scale 1 only
``pos`` is used. This package ships both unchanged (``seedvr2/data``); how ``auto`` picks one, or a
path overrides it: docs/options.md, ``text_embeddings``."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from ..options import option_ref
from .source import CheckpointError, aligned
from .weight_files import open_weights, sniff_format

# The official pos/neg embeddings of both DiT families (txt_in_dim 5120): seedvr2/data/README.md.
BUNDLED_TEXT_EMBEDDINGS = Path(__file__).resolve().parents[1] / "data" / \
    "official_text_embeddings.safetensors"


def _read_pos(path: Path) -> torch.Tensor:
    if sniff_format(path) == "pickle":  # .pt: a bare tensor, or a dict with "pos"
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(f"{path}: cannot read text embeddings (the file needs code to "
                                  f"unpickle, which is refused for safety)") from None
        except MemoryError:
            raise
        except Exception as e:
            # What the unpickler says can quote the file's bytes, which are never echoed.
            raise CheckpointError(f"{path}: cannot read text embeddings (damaged torch file: "
                                  f"{type(e).__name__})") from None
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, dict) and isinstance(obj.get("pos"), torch.Tensor):
            return obj["pos"]
        raise CheckpointError(f"{path}: expected a tensor or a dict with a 'pos' tensor")
    with open_weights(path) as src:
        key = _positive_key(src.shapes)
        if key is None:
            raise CheckpointError(f"{path}: expected a 'pos' tensor (found {sorted(src.shapes)[:5]})")
        return src.get(key)


def _positive_key(shapes) -> str | None:
    """``pos`` (our embedding files) or ``positive_conditioning`` (ComfyUI's DiT repackages)."""
    return next((k for k in ("pos", "positive_conditioning") if k in shapes), None)


def _check(pos: torch.Tensor, path: Path, txt_in_dim: int) -> torch.Tensor:
    if pos.dim() == 3 and pos.shape[0] == 1:
        pos = pos[0]
    if pos.dim() != 2 or pos.shape[0] < 1:
        raise CheckpointError(f"{path}: text embeddings must be (tokens, width), got {tuple(pos.shape)}")
    if pos.shape[1] != txt_in_dim:
        raise CheckpointError(f"{path}: text embeddings have width {pos.shape[1]} but the DiT "
                              f"expects txt_in_dim {txt_in_dim}; use the embeddings that ship "
                              f"with this model")
    return aligned(pos.float())


def load_text_embeddings(spec: str, txt_in_dim: int, model_dir: Path,
                         embedded: torch.Tensor | None = None, source=None) -> torch.Tensor:
    """The positive text embedding (tokens, txt_in_dim) in fp32. ``embedded``, the one inside the
    DiT's file (``dit.embedded_text_embeddings["pos"]``, ComfyUI's ``positive_conditioning``), is
    used first by ``spec="auto"``; ``source`` (the DiT file) names it in errors."""
    if spec == "auto" and embedded is not None:
        return _check(embedded, Path(source or "the DiT file's positive_conditioning"), txt_in_dim)
    if spec != "auto":
        path = Path(spec).expanduser()
        if not path.is_file():
            raise CheckpointError(f"{path}: text embeddings file not found")
        return _check(_read_pos(path), path, txt_in_dim)
    model_dir = Path(model_dir)
    candidates = [model_dir / "pos_emb.pt", *sorted(model_dir.glob("*.safetensors")),
                  BUNDLED_TEXT_EMBEDDINGS]
    widths = []
    for path in candidates:
        if not path.is_file():
            continue
        name = "the bundled official embeddings" if path == BUNDLED_TEXT_EMBEDDINGS else path.name
        if path.suffix == ".safetensors" and path != BUNDLED_TEXT_EMBEDDINGS:
            try:
                with open_weights(path) as src:
                    shape = src.shapes.get(_positive_key(src.shapes) or "pos")
            except CheckpointError:
                continue
            if shape is None:
                continue
            widths.append(f"{name} ({shape[-1]})")
            if shape[-1] != txt_in_dim:
                continue
        pos = _read_pos(path)
        if pos.shape[-1] == txt_in_dim:
            return _check(pos, path, txt_in_dim)
        widths.append(f"{name} ({pos.shape[-1]})")
    found = f"; found {', '.join(widths)}" if widths else ""
    raise CheckpointError(f"no text embeddings of width {txt_in_dim} in {model_dir}: put the "
                          f"model's pos_emb.pt there or pass {option_ref('text_embeddings', 'PATH')}"
                          f"{found}")
