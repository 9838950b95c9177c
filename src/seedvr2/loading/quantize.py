"""``seedvr2 quantize``: any supported weight file -> GGUF, fp8, int8, mxfp8 or nvfp4 weights.

Targets, their layouts (Comfy-Org's for int8_convrot/mxfp8/nvfp4) and what stays
unquantised (:data:`SMALL_TENSOR`, the models' input/output layers, ``keep`` prefixes):
docs/models.md, "Writing". Tensors are converted one at a time into a temporary file that is
renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..options import option_ref
from .formats import SAFETENSORS_DTYPES, CheckpointError, TensorSource, open_weights
from .quantized import (E2M1_MAX, E2M1_VALUES, E4M3_MAX, PackedWeight, regular_hadamard,
                        scan_safetensors_layout, swizzle_block_scales)

GGUF_TARGETS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16")
SAFETENSORS_TARGETS = ("fp8_e4m3fn", "fp8_e5m2", "int8", "int8_convrot", "mxfp8", "nvfp4")
TARGETS = GGUF_TARGETS + SAFETENSORS_TARGETS

SMALL_TENSOR = 4096  # values; smaller weights stay unquantised
ALWAYS_KEEP = ("vid_in.", "txt_in.", "emb_in.", "vid_out.", "encoder.conv_in.",
               "decoder.conv_out.", "quant_conv.", "post_quant_conv.",
               "positive_conditioning", "negative_conditioning")
_BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "BF16": 1, "F16": 1}
_FP8 = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_ST_DTYPE = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}  # the header's names


def _stored_float(dtype: torch.dtype) -> torch.dtype:
    """The dtype an unquantised tensor keeps: its own float dtype, fp16 for narrower ones."""
    return dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float16


def should_quantize(key: str, shape: Sequence[int], keep: tuple[str, ...] = ()) -> bool:
    """Whether ``quantize`` packs this tensor (docs/models.md, "Writing", for what stays)."""
    return (key.endswith(".weight") and len(shape) >= 2 and math.prod(shape) >= SMALL_TENSOR
            and not key.startswith(ALWAYS_KEEP) and not key.startswith(keep))


def _model_config(src: TensorSource) -> tuple[str, dict]:
    from .detect import describe_unknown, model_kind
    from .load import _config_for

    kind = model_kind(src.shapes)
    if kind is None:
        raise CheckpointError(f"{src.path}: {describe_unknown(src.shapes)}")
    return kind, _config_for(src, kind).to_dict()


@dataclass
class QuantizeSummary:
    output: Path
    kind: str
    target: str
    quantized: int
    kept: int
    input_bytes: int
    output_bytes: int


def quantize_file(source, output, target: str, keep: Sequence[str] = (), overwrite: bool = False,
                  progress: Optional[Callable[[int, int], None]] = None) -> QuantizeSummary:
    """Convert ``source`` (any format the loader reads) to ``target`` at ``output``."""
    if target not in TARGETS:
        raise ValueError(f"{option_ref('target', repr(target), flag='--type')}: expected one of "
                         f"{', '.join(TARGETS)}")
    output = Path(output)
    want = ".gguf" if target in GGUF_TARGETS else ".safetensors"
    if output.suffix.lower() != want:
        raise ValueError(f"{output}: a {target} file is written as {want}; name it "
                         f"{output.with_suffix(want).name}")
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists; pass {option_ref('overwrite', True)} to replace it")
    tmp = output.with_name(output.name + ".partial")
    with open_weights(source) as src:
        kind, config = _model_config(src)
        try:
            writer = _write_gguf if target in GGUF_TARGETS else _write_safetensors
            prefixes = tuple(k if k.endswith(".") else k + "." for k in keep)
            counts = writer(src, tmp, target, config, prefixes, progress)
            os.replace(tmp, output)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return QuantizeSummary(output, kind, target, counts[0], counts[1],
                           Path(source).stat().st_size, output.stat().st_size)


# ---------------------------------------------------------------------------------------------
# GGUF


@dataclass
class _GGUFPlan:
    key: str
    qtype: str  # GGML type written
    stored: tuple[int, ...]  # shape as written (torch order)
    orig: Optional[tuple[int, ...]]  # logical shape when it differs from `stored`


def _gguf_plan(src: TensorSource, target: str, keep) -> list[_GGUFPlan]:
    plans = []
    for key, shape in src.shapes.items():
        shape = tuple(shape)
        numel = math.prod(shape)
        quantize = should_quantize(key, shape, keep)
        block = _BLOCK[target]
        if quantize and (len(shape) > 2 or shape[-1] % block):
            # Rows must tile into blocks: store flat in rows of 256 (or of one block).
            rows = 256 if numel % 256 == 0 else block if numel % block == 0 else None
            if rows is None:
                quantize = False
            else:
                plans.append(_GGUFPlan(key, target, (numel // rows, rows), shape))
                continue
        if quantize:
            plans.append(_GGUFPlan(key, target, shape, None))
            continue
        float_type = _ST_DTYPE[_stored_float(src.dtypes[key]) if key not in src.packed
                               else torch.float16]
        if len(shape) > 4:  # GGUF holds at most 4 dimensions
            plans.append(_GGUFPlan(key, float_type, (shape[0], numel // shape[0]), shape))
        else:
            plans.append(_GGUFPlan(key, float_type, shape, None))
    return plans


def _gguf_bytes(tensor: torch.Tensor, qtype: str):
    """The tensor in GGML type ``qtype`` as the numpy array the gguf writer takes."""
    import gguf
    import numpy as np

    if qtype == "F32":
        return tensor.to(torch.float32).contiguous().numpy()
    if qtype == "F16":
        return tensor.to(torch.float16).contiguous().numpy()
    if qtype == "BF16":  # raw bytes, exact (torch rounds fp32 -> bf16 to nearest even)
        bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        return bits.view(np.uint8)
    return gguf.quants.quantize(tensor.to(torch.float32).contiguous().numpy(),
                                getattr(gguf.GGMLQuantizationType, qtype))


def _write_gguf(src: TensorSource, path: Path, target: str, config: dict, keep, progress):
    import gguf
    import numpy as np

    from .gguf import CONFIG_KEY, ORIG_SHAPE_KEY, config_json

    plans = _gguf_plan(src, target, keep)
    writer = gguf.GGUFWriter(path, arch="seedvr2")
    try:
        writer.add_string(CONFIG_KEY, config_json(config))
        writer.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8,
                              "Q5_1": 9, "BF16": 32}[target])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for plan in plans:
            if plan.orig is not None:
                writer.add_array(ORIG_SHAPE_KEY + plan.key, list(plan.orig))
            ggml = getattr(gguf.GGMLQuantizationType, plan.qtype)
            block, type_size = gguf.GGML_QUANT_SIZES[ggml]
            nbytes = math.prod(plan.stored) // block * type_size
            if plan.qtype in ("F32", "F16"):
                numpy_dtype = np.dtype(np.float32 if plan.qtype == "F32" else np.float16)
                writer.add_tensor_info(plan.key, plan.stored, numpy_dtype, nbytes)
            else:
                byte_shape = (*plan.stored[:-1], plan.stored[-1] // block * type_size)
                writer.add_tensor_info(plan.key, byte_shape, np.dtype(np.uint8), nbytes, ggml)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, plan in enumerate(plans):
            tensor = src.get(plan.key).reshape(plan.stored)
            writer.write_tensor_data(_gguf_bytes(tensor, plan.qtype))
            if progress:
                progress(i + 1, len(plans))
    finally:
        writer.close()
    quantized = sum(p.qtype == target and should_quantize(p.key, src.shapes[p.key], keep)
                    for p in plans)
    return quantized, len(plans) - quantized


# ---------------------------------------------------------------------------------------------
# fp8 / int8 safetensors


def quantize_fp8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values, fp32 scale)`` with ``weight ≈ values·scale`` (per-tensor absmax scale)."""
    largest = torch.finfo(dtype).max
    w = weight.to(torch.float32)
    scale = (w.abs().amax() / largest).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-largest, largest).to(dtype), scale.reshape(())


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 codes, fp32 scale (rows, 1))`` with one absmax scale per output channel."""
    w = weight.to(torch.float32).reshape(weight.shape[0], -1)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return codes.reshape(weight.shape), scale


def convrot_group(cols: int) -> Optional[int]:
    """The ConvRot group for ``cols`` input channels: the largest power of 4 up to 256 (the
    group ComfyUI's files use) that divides them, at least 16; None when none does."""
    return next((g for g in (256, 64, 16) if cols % g == 0), None)


def quantize_int8_convrot(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8_rows` of ``W·H`` (``H`` the regular Hadamard matrix per group of
    ``group`` input channels): the rotation spreads outliers over their group."""
    rows, cols = weight.shape
    h = regular_hadamard(group, device=weight.device)
    rotated = (weight.to(torch.float32).view(rows, cols // group, group) @ h).view(rows, cols)
    return quantize_int8_rows(rotated)


def quantize_mxfp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 values, swizzled E8M0 exponents)``: each run of 32 values along a row shares the
    smallest power of two that brings its absmax within e4m3's 448."""
    rows, cols = weight.shape
    blocks = weight.to(torch.float32).view(rows, cols // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -127 * E4M3_MAX)
    exponent = (torch.ceil(torch.log2(amax / E4M3_MAX)).to(torch.int32) + 127).clamp(1, 254)
    values = blocks / torch.exp2(exponent.float() - 127).unsqueeze(-1)
    data = values.clamp(-E4M3_MAX, E4M3_MAX).reshape(rows, cols).to(torch.float8_e4m3fn)
    return data, swizzle_block_scales(exponent.to(torch.uint8)).view(torch.float8_e8m0fnu)


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed e2m1 pairs, swizzled e4m3 block scales, fp32 tensor scale)``: 16 values share
    an e4m3 scale (their absmax / 6, in units of the tensor scale absmax / (448·6)); values
    round to the nearest e2m1 (first of each pair in the high nibble). Bit for bit what
    comfy-kitchen's ``quantize_nvfp4`` writes with the same tensor scale (tested)."""
    rows, cols = weight.shape
    w = weight.to(torch.float32)
    scale_2 = (w.abs().amax() / (E4M3_MAX * E2M1_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    blocks = w.view(rows, cols // 16, 16)
    block = (blocks.abs().amax(-1) / E2M1_MAX / scale_2).to(torch.float8_e4m3fn)
    step = (block.float() * scale_2).unsqueeze(-1)
    scaled = torch.where(step > 0, blocks / torch.where(step > 0, step, 1.0), 0.0)
    # The magnitude's code (0-7) counts the midpoints between neighbouring e2m1 magnitudes it
    # passes; at a midpoint it rounds to the even code, as comfy-kitchen's quantiser does.
    magnitude = scaled.abs().reshape(rows, cols)
    codes = torch.zeros(rows, cols, dtype=torch.uint8, device=weight.device)
    for code, (low, high) in enumerate(zip(E2M1_VALUES[:7], E2M1_VALUES[1:8])):
        middle = (low + high) / 2
        codes += (magnitude > middle if code % 2 == 0 else magnitude >= middle).to(torch.uint8)
    codes |= (scaled.reshape(rows, cols) < 0).to(torch.uint8) << 3  # the sign is bit 3
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    return packed, swizzle_block_scales(block.view(torch.uint8)).view(torch.float8_e4m3fn), \
        scale_2.reshape(())


def _scales_shape(rows: int, blocks: int) -> tuple[int, int]:
    """The swizzled block-scale matrix of ``rows`` x ``blocks`` scales (128 x 4 tiles)."""
    return -(-rows // 128) * 128, -(-blocks // 4) * 4


def _layer_layout(target: str, layer: str, shape: tuple) -> Optional[tuple[dict, dict]]:
    """``(comfy_quant config, {tensor: (dtype, shape)})`` of one quantised layer, or None when
    the layer's shape does not fit the target's blocks (it is then kept unquantised)."""
    weight, scale = f"{layer}.weight", f"{layer}.weight_scale"
    rows, cols = shape[0], shape[-1]
    if target in _FP8:
        fmt = "float8_e4m3fn" if target == "fp8_e4m3fn" else "float8_e5m2"
        return {"format": fmt}, {weight: (_FP8[target], shape), scale: (torch.float32, ())}
    if target == "int8":
        return ({"format": "int8_tensorwise"},
                {weight: (torch.int8, shape), scale: (torch.float32, (rows, 1))})
    if len(shape) != 2:
        return None
    if target == "int8_convrot":
        group = convrot_group(cols)
        return None if group is None else (
            {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group},
            {weight: (torch.int8, shape), scale: (torch.float32, (rows, 1))})
    if target == "mxfp8":
        return None if cols % 32 else ({"format": "mxfp8"}, {
            weight: (torch.float8_e4m3fn, shape),
            scale: (torch.float8_e8m0fnu, _scales_shape(rows, cols // 32))})
    if cols % 32 or rows % 16:  # nvfp4: the shapes its matmul takes (memory.compute_path)
        return None
    return {"format": "nvfp4"}, {weight: (torch.uint8, (rows, cols // 2)),
                                 scale: (torch.float8_e4m3fn, _scales_shape(rows, cols // 16)),
                                 f"{layer}.weight_scale_2": (torch.float32, ())}


def pack_weight(weight: torch.Tensor, target: str) -> Optional[PackedWeight]:
    """``weight`` in a safetensors ``target`` as the loader holds it after reading the file
    ``quantize`` writes (on the weight's device); None where the layer does not fit the target."""
    found = _layer_layout(target, "layer", tuple(weight.shape))
    if found is None:
        return None
    conf, layout = found
    marker = torch.frombuffer(bytearray(json.dumps(conf).encode()), dtype=torch.uint8)
    # The tensors of the file, read back through the loader's own layout scan.
    tensors = dict(zip([*layout, "layer.comfy_quant"], _encode(weight, target, marker)))
    read = scan_safetensors_layout({k: tuple(t.shape) for k, t in tensors.items()},
                                   {k: t.dtype for k, t in tensors.items()}, {},
                                   lambda key: tensors[key].cpu().numpy().tobytes())
    return read.packed["layer.weight"].read(tensors.__getitem__)


def _safetensors_plan(src: TensorSource, target: str, keep):
    """[(key, {name: (dtype, shape)}, comfy_quant marker or None)] in file order."""
    plans = []
    for key, shape in src.shapes.items():
        shape = tuple(shape)
        found = should_quantize(key, shape, keep) and \
            _layer_layout(target, key[: -len(".weight")], shape)
        if found:
            conf, layout = found
            marker = torch.frombuffer(bytearray(json.dumps(conf).encode()), dtype=torch.uint8)
            layout[f"{key[: -len('.weight')]}.comfy_quant"] = (torch.uint8, tuple(marker.shape))
            plans.append((key, layout, marker))
        else:
            dtype = torch.float16 if key in src.packed else _stored_float(src.dtypes[key])
            plans.append((key, {key: (dtype, shape)}, None))
    return plans


def _encode(tensor: torch.Tensor, target: str, marker: torch.Tensor) -> list[torch.Tensor]:
    """One quantised layer's tensors, in the order of its layout."""
    if target == "int8":
        parts = quantize_int8_rows(tensor)
    elif target == "int8_convrot":
        parts = quantize_int8_convrot(tensor, json.loads(bytes(marker))["convrot_groupsize"])
    elif target == "mxfp8":
        parts = quantize_mxfp8(tensor)
    elif target == "nvfp4":
        parts = quantize_nvfp4(tensor)
    else:
        parts = quantize_fp8(tensor, _FP8[target])
    return [*parts, marker]


def _write_safetensors(src: TensorSource, path: Path, target: str, config: dict, keep,
                       progress):
    plans = _safetensors_plan(src, target, keep)
    header, offset = {}, 0
    for _, layout, _ in plans:
        for name, (dtype, shape) in layout.items():
            size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
    header["__metadata__"] = {"config": json.dumps(config, sort_keys=True),
                              "seedvr2.quantization": target}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i, (key, layout, marker) in enumerate(plans):
            tensor = src.get(key)
            if marker is None:
                (dtype, _), = layout.values()
                tensors = [tensor.to(dtype)]
            else:
                tensors = _encode(tensor, target, marker)
            for (name, (dtype, shape)), tensor in zip(layout.items(), tensors, strict=True):
                assert tensor.dtype == dtype and tuple(tensor.shape) == shape, name
                f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            if progress:
                progress(i + 1, len(plans))
    quantized = sum(p[2] is not None for p in plans)
    return quantized, len(plans) - quantized
