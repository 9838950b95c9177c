"""GGUF weight files: read with the ``gguf`` package, dequantised in torch on the device.

Reading. ``gguf.GGUFReader`` memory-maps the file; every tensor becomes a torch view of the
map (no copy). F32/F16/BF16 tensors are plain tensors; quantised ones stay packed as their raw
GGML blocks, ``(n_blocks, type_size)`` bytes, in a :class:`~.quantized.PackedWeight`.
Conventions shared with ComfyUI-GGUF:

* a ``model.diffusion_model.`` key prefix is stripped;
* GGUF holds at most 4 dimensions, so a weight of more dimensions (the VAE's 3-D convolutions)
  or whose rows do not tile into blocks is stored flattened, its real shape in the metadata key
  ``comfy.gguf.orig_shape.<tensor name>`` (an integer array); GGML blocks run along the flat
  row-major data, so dequantising the flat data and reshaping gives the weight;
* the ``seedvr2.config`` metadata key, when present, holds the model config as JSON (like the
  safetensors ``config`` entry).

Dequantisation. :func:`dequantize_blocks` decodes GGML blocks with vectorised torch integer and
float ops on whatever device the bytes are on. Each type follows the GGML block layout and the
order of float operations of ``gguf.quants`` (fp16 scales widened to fp32, products in fp32), so
on the same bytes the fp32 result is bit-for-bit that of ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from .formats import CheckpointError, TensorSource
from .quantized import PackedEntry, PackedWeight

QK_K = 256  # super-block size of the K-quants

# GGML type name -> (values per block, bytes per block)
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
}
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED_TYPES = (*PLAIN_TYPES, *BLOCK_SIZES)

PREFIX = "model.diffusion_model."
ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
CONFIG_KEY = "seedvr2.config"


# ---------------------------------------------------------------------------------------------
# dequantisation kernels: (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as an fp32 column ``(n, 1)``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(device, *values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes ``(n, m)`` -> ``(n, 2, m)``: low nibbles, then high nibbles."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """Bytes ``(n, m)`` -> ``(n, 8, m)``: bit ``i`` of every byte in row ``i``."""
    return (qh.unsqueeze(1) >> _shifts(qh.device, *range(8)).view(1, 8, 1)) & 1


def _little_endian_bits(word: torch.Tensor) -> torch.Tensor:
    """A little-endian 32-bit word as 4 bytes ``(n, 4)`` -> its 32 bits ``(n, 32)``, bit 0 first."""
    return ((word.unsqueeze(-1) >> _shifts(word.device, *range(8))) & 1).reshape(word.shape[0], 32)


def _q8_0(b):
    d = _f16(b, 0)
    return torch.mul(b[:, 2:].view(torch.int8), d)


def _q4_0(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:]).reshape(-1, 32).view(torch.int8) - 8
    return torch.mul(q, d)


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:]).reshape(-1, 32)
    return torch.mul(q, d) + m


def _q5(b, offset):
    high = _little_endian_bits(b[:, offset:offset + 4])
    low = _nibbles(b[:, offset + 4:]).reshape(-1, 32)
    return low | (high << 4)


def _q5_0(b):
    d = _f16(b, 0)
    return torch.mul(_q5(b, 2).view(torch.int8) - 16, d)


def _q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    return torch.mul(_q5(b, 4), d) + m


def _q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    # 2-bit codes: byte j of each 32-byte half holds elements j, j+32, j+64, j+96 of that half.
    q = (qs.view(n, 2, 1, 32) >> _shifts(b.device, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3
    return (dl * q.view(n, 16, 16).to(torch.float32) - ml).view(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 signed 6-bit scales: low 4 bits in bytes 0-7 (two per byte), high 2 bits in bytes 8-11.
    low = (packed[:, :8].view(n, 1, 8) >> _shifts(b.device, 0, 4).view(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].view(n, 1, 4) >> _shifts(b.device, 0, 2, 4, 6).view(1, 4, 1)).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).view(torch.int8) - 32
    dl = (d * scales.to(torch.float32)).view(n, 16, 1)
    ql = ((qs.view(n, 2, 1, 32) >> _shifts(b.device, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3)
    qh = (_bits(hmask).view(n, 16, 16)) ^ 1  # a set mask bit means "no offset of -4"
    q = ql.view(n, 16, 16).view(torch.int8) - (qh << 2).view(torch.int8)
    return (dl * q.to(torch.float32)).view(n, QK_K)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K super-block (12 bytes)."""
    n = packed.shape[0]
    d, m, md = packed.view(n, 3, 4).unbind(1)
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scales, mins


def _k_affine(b, q):
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k_scales_mins(b[:, 4:16])
    dl = (d * scales.to(torch.float32)).view(n, 8, 1)
    ml = (dmin * mins.to(torch.float32)).view(n, 8, 1)
    return (dl * q.to(torch.float32) - ml).view(n, QK_K)


def _q4_k(b):
    n = b.shape[0]
    # Each 32-byte group holds 64 values: 32 in the low nibbles, then 32 in the high nibbles.
    q = (b[:, 16:].view(n, 4, 1, 32) >> _shifts(b.device, 0, 4).view(1, 1, 2, 1)) & 0x0F
    return _k_affine(b, q.view(n, 8, 32))


def _q5_k(b):
    n = b.shape[0]
    low = (b[:, 48:].view(n, 4, 1, 32) >> _shifts(b.device, 0, 4).view(1, 1, 2, 1)) & 0x0F
    high = _bits(b[:, 16:48])
    return _k_affine(b, low.view(n, 8, 32) | (high << 4))


def _q6_k(b):
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    dl = (d * scales.view(torch.int8).to(torch.float32)).view(n, 16, 1)
    low = (ql.view(n, 2, 1, 64) >> _shifts(b.device, 0, 4).view(1, 1, 2, 1)) & 0x0F
    high = (qh.view(n, 2, 1, 32) >> _shifts(b.device, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).view(torch.int8) - 32
    return (dl * q.view(n, 16, 16).to(torch.float32)).view(n, QK_K)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_lookup(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def _iq4_nl(b):
    d = _f16(b, 0)
    return d * _iq4_lookup(_nibbles(b[:, 2:]).reshape(-1, 32))


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b, 0)
    high_word = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # 8 x 2 bits
    high = (high_word >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    low = _nibbles(b[:, 4:8]).transpose(1, 2).reshape(n, 8)  # sub-block j: nibble j % 2 of byte j // 2
    scales = (low.to(torch.int32) | (high << 4)) - 32
    dl = (d * scales.to(torch.float32)).view(n, 8, 1)
    q = _nibbles(b[:, 8:].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl * _iq4_lookup(q)).view(n, QK_K)


KERNELS = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}


def dequantize_blocks(blocks: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32
                      ) -> torch.Tensor:
    """GGML blocks of type ``qtype`` -> the flat float values, in ``dtype``, on their device.

    ``blocks`` is uint8, either ``(n_blocks, type_size)`` or any shape with that many bytes.
    """
    block_size, type_size = BLOCK_SIZES[qtype]
    blocks = blocks.reshape(-1, type_size)
    values = KERNELS[qtype](blocks).reshape(-1)
    return values if dtype == torch.float32 else values.to(dtype)


# ---------------------------------------------------------------------------------------------
# reading


def _field_value(field):
    """A metadata field's value: str, number, or list for arrays."""
    value = field.contents()
    return value


def open_gguf(path: Path) -> TensorSource:
    """A GGUF file as a :class:`TensorSource` (quantised tensors stay packed)."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the 'gguf' package "
                              f"(pip install gguf)") from None
    try:
        # Copy-on-write map: tensors are writable views for torch, the file is never changed.
        reader = gguf.GGUFReader(path, "c")
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors alike
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "GGMLQuantizationType" in detail:
            raise CheckpointError(f"{path}: a tensor uses a GGML type unknown to the installed "
                                  f"gguf package ({detail}); update gguf or re-quantise the "
                                  f"file") from None
        raise CheckpointError(f"{path}: unreadable GGUF file, truncated or corrupt "
                              f"({detail})") from None

    size = path.stat().st_size
    fields = reader.fields
    names = [t.name for t in reader.tensors]
    has_prefix = any(n.startswith(PREFIX) for n in names)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    plain: dict[str, torch.Tensor] = {}
    packed: dict[str, PackedEntry] = {}
    blocks: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = tensor.name
        key = name[len(PREFIX):] if has_prefix and name.startswith(PREFIX) else name
        qtype = tensor.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has GGML type {qtype}, which this "
                                  f"loader cannot dequantise (supported: "
                                  f"{', '.join(SUPPORTED_TYPES)})")
        if tensor.data_offset + tensor.n_bytes > size:
            raise CheckpointError(f"{path}: truncated GGUF file (tensor {name!r} ends at byte "
                                  f"{tensor.data_offset + tensor.n_bytes}, file has {size})")
        stored = tuple(int(v) for v in reversed(tensor.shape.tolist()))
        shape = stored
        if ORIG_SHAPE_KEY + name in fields:
            orig = _field_value(fields[ORIG_SHAPE_KEY + name])
            if not isinstance(orig, list) or not all(isinstance(v, int) for v in orig):
                raise CheckpointError(f"{path}: metadata {ORIG_SHAPE_KEY + name!r} must be an "
                                      f"integer array, got {orig!r}")
            shape = tuple(orig)
        numel = 1
        for s in shape:
            numel *= s
        if numel != tensor.n_elements:
            raise CheckpointError(f"{path}: tensor {name!r} has {tensor.n_elements} values but "
                                  f"its shape {list(shape)} needs {numel}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about non-writable numpy arrays
            data = torch.from_numpy(tensor.data)
        shapes[key] = shape
        if qtype in PLAIN_TYPES:
            if qtype == "BF16":  # the reader gives BF16 as raw bytes
                data = data.view(torch.uint8).reshape(-1).view(torch.bfloat16)
            plain[key] = data.reshape(shape)
            dtypes[key] = PLAIN_TYPES[qtype]
        else:
            blocks[key] = data.view(torch.uint8).reshape(-1, BLOCK_SIZES[qtype][1])
            packed[key] = PackedEntry("gguf", shape, {"blocks": key}, params={"qtype": qtype})
            dtypes[key] = torch.uint8

    metadata: dict[str, str] = {}
    if CONFIG_KEY in fields:
        config = _field_value(fields[CONFIG_KEY])
        if not isinstance(config, str):
            raise CheckpointError(f"{path}: metadata {CONFIG_KEY!r} must be a JSON string")
        metadata["config"] = config
    arch = fields.get("general.architecture")
    if arch is not None:
        metadata["general.architecture"] = str(_field_value(arch))

    def get(key: str) -> torch.Tensor:
        if key in packed:
            return packed[key].read(blocks.__getitem__).dequantize(torch.float32).reshape(shapes[key])
        return plain[key]

    def get_packed(key: str) -> PackedWeight:
        return packed[key].read(blocks.__getitem__)

    def close():
        plain.clear()
        blocks.clear()

    return TensorSource(path, "gguf", shapes=shapes, dtypes=dtypes, metadata=metadata,
                        packed={k: v.label for k, v in packed.items()},
                        _get=get, _get_packed=get_packed, _close=close)


def config_json(config: dict) -> str:
    """The ``seedvr2.config`` value for a model config dict."""
    return json.dumps(config, sort_keys=True)
