"""One loader for every weight file: open, detect, build on meta, check, assign tensor by tensor.
The model is never materialised twice: parameters are created on ``meta`` and replaced by the file's
tensors (converted one at a time), so peak memory is about one copy of the weights."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import nn

from ..models import build_on_meta, set_tensor
from ..models.config import ConfigError, DiTConfig, VAEConfig, dit_config, dit_family, vae_config
from ..models.rope import FrequencyTable, share_equal_tables
from .detect import describe_unknown, detect_dit, detect_vae, model_kind
from .source import CheckpointError, TensorSource, aligned
from .weight_files import open_weights
from .packed import PackedWeight, dtype_name, non_finite_values
from .packed_layers import attach_packed_weight, can_pack

log = logging.getLogger("seedvr2")

_STANDARD_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# Text embeddings that ComfyUI's repackaged DiT files carry beside the weights.
EMBEDDED_TEXT_KEYS = {"positive_conditioning": "pos", "negative_conditioning": "neg"}


def config_for(src: TensorSource, kind: str) -> DiTConfig | VAEConfig:
    """The model configuration a weight file holds (detected from its tensors; a ``config``
    metadata entry overrides), or one :class:`CheckpointError` naming the file."""
    found = model_kind(src.shapes)
    if found != kind:
        what = describe_unknown(src.shapes) if found is None else f"this is a {found.upper()} file"
        raise CheckpointError(f"{src.path}: expected a SeedVR2 {kind.upper()} checkpoint, but {what}")
    override = src.metadata_config()
    try:
        if kind == "vae":
            return vae_config({**detect_vae(src.shapes), **(override or {})})
        detected = detect_dit(src.shapes)
        if override is not None:
            try:
                same_family = dit_family(override) == dit_family(detected)
            except ConfigError:
                same_family = True
            detected = {**detected, **override} if same_family else override
        return dit_config(detected)
    except (ConfigError, CheckpointError) as e:
        raise CheckpointError(f"{src.path}: {e}") from None


def _target_dtype(src: TensorSource, requested: torch.dtype | None) -> torch.dtype:
    """The requested dtype, else the file's dominant float dtype (fp8 -> fp16, fp64 -> fp32)."""
    if requested is not None:
        return requested
    weight: dict[torch.dtype, int] = {}
    for key, dt in src.dtypes.items():
        if key in EMBEDDED_TEXT_KEYS:
            continue
        if key in src.packed:
            dt = torch.float16  # quantised storage computes in fp16 unless asked otherwise
        if dt.is_floating_point:
            dt = dt if dt in _STANDARD_FLOATS else torch.float32 if dt == torch.float64 else torch.float16
            weight[dt] = weight.get(dt, 0) + math.prod(src.shapes[key])
    return max(weight, key=weight.get) if weight else torch.float32


def _check_tensors(src: TensorSource, model: nn.Module, cfg) -> list[str]:
    """Compare the file with the model's state dict; returns the RoPE buffers the file lacks."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    summary = _summary(cfg)
    missing = [k for k in expected if k not in src.shapes]
    rope_missing = [k for k in missing if k.endswith("rope.rope.freqs")]
    missing = [k for k in missing if k not in rope_missing]
    unexpected = [k for k in src.shapes if k not in expected and k not in EMBEDDED_TEXT_KEYS]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s), e.g. {unexpected[:3]}")
        raise CheckpointError(f"{src.path}: {'; '.join(parts)} for {summary}")
    for key, shape in expected.items():
        if key in src.shapes and src.shapes[key] != shape:
            raise CheckpointError(f"{src.path}: tensor {key!r} has shape {list(src.shapes[key])}, "
                                  f"expected {list(shape)} for {summary}")
        if key in src.dtypes and key not in src.packed and not src.dtypes[key].is_floating_point:
            raise CheckpointError(f"{src.path}: tensor {key!r} has dtype {src.dtypes[key]}, "
                                  f"expected a floating-point tensor")
    return rope_missing


def _summary(cfg) -> str:
    if isinstance(cfg, DiTConfig):
        return (f"a {cfg.family.upper()}-family DiT (vid_dim {cfg.vid_dim}, {cfg.heads} heads x "
                f"{cfg.head_dim}, {cfg.num_layers} layers, txt_in_dim {cfg.txt_in_dim})")
    return f"a VAE (block_out_channels {list(cfg.block_out_channels)})"


def _assign_packed(model: nn.Module, key: str, src: TensorSource, target: torch.dtype, device,
                   keep_packed: bool):
    """A quantised weight: kept packed in a linear/conv (dequantised per forward), else expanded."""
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    packed = finite_parts(src, key, src.get_packed(key).to(device))
    if keep_packed and can_pack(module, name):
        attach_packed_weight(module, packed, target, module_name)
    else:
        set_tensor(model, key, finite(src, key, packed.dequantize(target)))


def finite(src: TensorSource, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the file's tensor ``key`` as it will be used), or one :class:`CheckpointError`
    naming the tensor when it holds NaN or infinite values: those give black frames."""
    if not bool(non_finite_values(tensor).any()):
        return tensor
    if tensor.dtype == src.dtypes.get(key) or bool(non_finite_values(src.get(key)).any()):
        raise CheckpointError(f"{src.path}: tensor {key!r} holds NaN or infinite values; the "
                              f"file is damaged (re-download or re-convert it)")
    raise CheckpointError(f"{src.path}: tensor {key!r} overflows {dtype_name(tensor.dtype)} (largest "
                          f"finite value {torch.finfo(tensor.dtype).max:g}); load the model in "
                          f"bfloat16 or float32 (--dtype bf16 or fp32)")


def finite_parts(src: TensorSource, key: str, packed: PackedWeight) -> PackedWeight:
    """``packed``, or one :class:`CheckpointError` naming the stored tensor that holds NaN or
    infinite values (a scale, fp8 codes, GGUF block scales)."""
    part = packed.non_finite_part()
    if part is None:
        return packed
    stored = src.part_keys.get(key, {}).get(part, key)
    raise CheckpointError(f"{src.path}: tensor {stored!r} holds NaN or infinite values; the file "
                          f"is damaged (re-download or re-convert it)")


def checked_model(src: TensorSource, kind: str) -> tuple[nn.Module, list[str]]:
    """The model ``src`` describes, built on ``meta``, with every tensor of the file checked
    against it (names, shapes, float dtypes); and the RoPE buffers the file lacks."""
    cfg = config_for(src, kind)
    model = build_on_meta(kind, cfg)
    return model, _check_tensors(src, model, cfg)


def _load(path, kind: str, dtype: torch.dtype | None, device, keep_packed: bool = True
          ) -> nn.Module:
    with open_weights(path) as src:
        model, rope_missing = checked_model(src, kind)
        target = _target_dtype(src, dtype)
        embedded = {}
        for key in src.shapes:
            if key in EMBEDDED_TEXT_KEYS:
                embedded[EMBEDDED_TEXT_KEYS[key]] = finite(src, key, aligned(src.get(key).float()))
                continue
            if key in src.packed:
                _assign_packed(model, key, src, target, device, keep_packed)
                continue
            keep_fp32 = key.endswith("rope.rope.freqs")
            tensor = src.get(key).to(device=device, dtype=torch.float32 if keep_fp32 else target)
            set_tensor(model, key, aligned(finite(src, key, tensor)))
        if rope_missing:
            log.info("%s: %d RoPE frequency buffers absent from the file; recomputed",
                     Path(path).name, len(rope_missing))
            for key in rope_missing:
                table: FrequencyTable = model.get_submodule(key.rsplit(".", 1)[0])
                table.freqs = table.defining_values().to(device)
    if kind == "dit":
        share_equal_tables(model)
    # {"pos", "neg"} from a ComfyUI repackage, fp32 on the CPU; see loading.text.
    model.embedded_text_embeddings = embedded
    # Where the weights came from: a resumed job compares models by this file's content.
    model.weights_file = str(Path(path).resolve())
    model.eval().requires_grad_(False)
    return model


def load_dit(path, dtype: torch.dtype | None = None, device="cpu", keep_packed: bool = True
             ) -> nn.Module:
    """A NaDiT (3B or 7B family, detected) from a safetensors, .pth/.pt or GGUF file. ``dtype``
    converts floating tensors (RoPE tables stay fp32); None keeps the file's (fp16 if quantised).
    Quantised linear and convolution weights stay packed on ``device``, dequantised to ``dtype``
    in each forward; ``keep_packed=False`` expands them once at load."""
    return _load(path, "dit", dtype, torch.device(device), keep_packed)


def load_vae(path, dtype: torch.dtype | None = None, device="cpu", keep_packed: bool = True
             ) -> nn.Module:
    """The video VAE from a safetensors, .pth/.pt or GGUF file (see :func:`load_dit`)."""
    return _load(path, "vae", dtype, torch.device(device), keep_packed)


def describe(path) -> dict:
    """What a weight file holds, read from its header alone (no tensor data is loaded)."""
    with open_weights(path) as src:
        kind = model_kind(src.shapes)
        if kind is None:
            raise CheckpointError(f"{src.path}: {describe_unknown(src.shapes)}")
        cfg = config_for(src, kind)
        dtypes = sorted({src.packed.get(k) or dtype_name(d)
                         for k, d in src.dtypes.items()})
        count = sum(math.prod(shape) for key, shape in src.shapes.items()
                    if not key.endswith("rope.rope.freqs") and key not in EMBEDDED_TEXT_KEYS)
        info = {"file": str(src.path), "format": src.format, "kind": kind, "dtypes": dtypes,
                "parameters": count, "tensors": len(src.shapes)}
        if isinstance(cfg, DiTConfig):
            info.update(family=cfg.family, vid_dim=cfg.vid_dim, heads=cfg.heads,
                        head_dim=cfg.head_dim, num_layers=cfg.num_layers,
                        mm_layers=cfg.mm_layers, txt_in_dim=cfg.txt_in_dim, mlp_type=cfg.mlp_type)
        else:
            info.update(block_out_channels=list(cfg.block_out_channels),
                        latent_channels=cfg.latent_channels, norm_num_groups=cfg.norm_num_groups)
        return info
