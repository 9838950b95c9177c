"""``seedvr2 quantize``: any supported weight file -> GGUF, fp8, int8, mxfp8 or nvfp4 weights,
one tensor at a time into a temporary file renamed when complete. Targets, layouts and what
stays unquantised: docs/models.md, "Writing"."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..errors import InputError, OutputExists
from ..options import OptionError, option_ref
from .detect import describe_unknown, model_kind
from .gguf import CONFIG_KEY, ORIG_SHAPE_KEY, config_json
from .load import checked_model, finite, finite_parts
from .packed import PackedWeight
from .safetensors import SAFETENSORS_DTYPES, scan_safetensors_layout
from .source import CheckpointError, TensorSource
from .weight_files import open_weights
from .format_table import TARGETS as LAYER_TARGETS

GGUF_TARGETS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "F16")
SAFETENSORS_TARGETS = tuple(LAYER_TARGETS)  # fp8_e4m3fn, fp8_e5m2, int8, int8_convrot, mxfp8, nvfp4
TARGETS = GGUF_TARGETS + SAFETENSORS_TARGETS

SMALL_TENSOR = 4096  # values; smaller weights stay unquantised
ALWAYS_KEEP = ("vid_in.", "txt_in.", "emb_in.", "vid_out.", "encoder.conv_in.",
               "decoder.conv_out.", "quant_conv.", "post_quant_conv.",
               "positive_conditioning", "negative_conditioning")
_BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "BF16": 1, "F16": 1}
_ST_DTYPE = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}  # the header's names
_ST_DTYPE[torch.uint8] = "U8"  # F8_E8M0 bytes as U8: ComfyUI's reader knows no F8_E8M0

VAE_LAYOUTS_REFUSED = (
    "the VAE is not written in ComfyUI's quantised layouts: ComfyUI builds the SeedVR2 VAE "
    "with manual_cast, which reads no comfy_quant marker, so such a file would not load right "
    "there. Quantise the DiT, keep the VAE in fp16, or use a GGUF type (Q8_0 ...) for this "
    "loader")


def _kept_dtype(src: TensorSource, key: str) -> torch.dtype:
    """A tensor left unquantised is written in its own float dtype (fp16 if narrower or packed)."""
    dtype = torch.float16 if key in src.packed else src.dtypes[key]
    return dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float16


def should_quantize(key: str, shape: Sequence[int], keep: tuple[str, ...] = ()) -> bool:
    """Whether ``quantize`` packs this tensor (docs/models.md, "Writing", for what stays)."""
    return (key.endswith(".weight") and len(shape) >= 2 and math.prod(shape) >= SMALL_TENSOR
            and not key.startswith(ALWAYS_KEEP) and not key.startswith(keep))


def _model_config(src: TensorSource) -> tuple[str, dict]:
    """The model kind and config of ``src``, every tensor checked as the loader checks it."""
    kind = model_kind(src.shapes)
    if kind is None:
        raise CheckpointError(f"{src.path}: {describe_unknown(src.shapes)}")
    model, _ = checked_model(src, kind)
    return kind, model.config.to_dict()


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
        raise OptionError(f"{option_ref('target', repr(target), flag='--type')}: expected one of "
                          f"{', '.join(TARGETS)}")
    output = Path(output)
    want = ".gguf" if target in GGUF_TARGETS else ".safetensors"
    if output.suffix.lower() != want:
        raise InputError(f"{output}: a {target} file is written as {want}; name it "
                         f"{output.with_suffix(want).name}")
    if output.exists() and not overwrite:
        raise OutputExists(f"{output} exists; pass {option_ref('overwrite', True)} to replace it")
    tmp = output.with_name(output.name + ".partial")
    with open_weights(source) as src:
        kind, config = _model_config(src)
        if kind == "vae" and target in SAFETENSORS_TARGETS:
            raise CheckpointError(f"{src.path}: --type {target}: {VAE_LAYOUTS_REFUSED}")
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


@dataclass
class _GGUFPlan:
    key: str
    qtype: str  # GGML type written
    stored: tuple[int, ...]  # shape as written (torch order)
    orig: Optional[tuple[int, ...]]  # logical shape when it differs from `stored`


def _gguf_plan(src: TensorSource, target: str, keep) -> list[_GGUFPlan]:
    plans = []
    for key, shape in src.shapes.items():
        shape, numel, block = tuple(shape), math.prod(shape), _BLOCK[target]
        quantize, stored = should_quantize(key, shape, keep), shape
        if quantize and (len(shape) > 2 or shape[-1] % block):
            # Rows must tile into blocks: store flat in rows of 256 (or of one block).
            rows = 256 if numel % 256 == 0 else block if numel % block == 0 else None
            quantize, stored = rows is not None, (numel // rows, rows) if rows else shape
        if quantize:
            qtype = target
        else:
            qtype = _ST_DTYPE[_kept_dtype(src, key)]
            stored = (shape[0], numel // shape[0]) if len(shape) > 4 else shape  # GGUF: <= 4-D
        plans.append(_GGUFPlan(key, qtype, stored, shape if stored != shape else None))
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

    plans = _gguf_plan(src, target, keep)
    writer = gguf.GGUFWriter(path, arch="seedvr2")
    try:
        writer.add_string(CONFIG_KEY, config_json(config))
        writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{target}"))
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
            tensor = _source_tensor(src, plan.key).reshape(plan.stored)
            writer.write_tensor_data(_gguf_bytes(tensor, plan.qtype))
            if progress:
                progress(i + 1, len(plans))
    finally:
        writer.close()
    quantized = sum(p.qtype == target and should_quantize(p.key, src.shapes[p.key], keep)
                    for p in plans)
    return quantized, len(plans) - quantized


def _source_tensor(src: TensorSource, key: str) -> torch.Tensor:
    """The source's tensor ``key`` in float, refused (naming the stored tensor) when it holds
    NaN or infinite values: quantising them would write NaN scales."""
    if key in src.packed:
        finite_parts(src, key, src.get_packed(key))
    return finite(src, key, src.get(key))


def pack_weight(weight: torch.Tensor, target: str) -> Optional[PackedWeight]:
    """``weight`` in a safetensors ``target`` as the loader holds it after reading the file
    ``quantize`` writes (on the weight's device); None where the layer does not fit the target."""
    found = LAYER_TARGETS[target].layout("layer", tuple(weight.shape))
    if found is None:
        return None
    marker, layout = found
    raw = torch.frombuffer(bytearray(json.dumps(marker).encode()), dtype=torch.uint8)
    # The tensors of the file, read back through the loader's own layout scan.
    tensors = dict(zip(layout, LAYER_TARGETS[target].encode(weight, marker), strict=True))
    tensors["layer.comfy_quant"] = raw
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
            LAYER_TARGETS[target].layout(key[: -len(".weight")], shape)
        if found:
            marker, layout = found
            raw = json.dumps(marker).encode()
            layout[f"{key[: -len('.weight')]}.comfy_quant"] = (torch.uint8, (len(raw),))
            plans.append((key, layout, marker))
        else:
            plans.append((key, {key: (_kept_dtype(src, key), shape)}, None))
    return plans


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
            tensor = _source_tensor(src, key)
            if marker is None:
                (dtype, _), = layout.values()
                tensors = [tensor.to(dtype)]
            else:
                tensors = [*LAYER_TARGETS[target].encode(tensor, marker),
                           torch.frombuffer(bytearray(json.dumps(marker).encode()),
                                            dtype=torch.uint8)]
            for (name, (dtype, shape)), tensor in zip(layout.items(), tensors, strict=True):
                assert tensor.dtype == dtype and tuple(tensor.shape) == shape, name
                f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            if progress:
                progress(i + 1, len(plans))
    quantized = sum(p[2] is not None for p in plans)
    return quantized, len(plans) - quantized
