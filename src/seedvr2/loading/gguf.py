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
# dequantisation kernels: blocks (n, type_size) uint8 -> out (n, block_size) float32, in place
#
# Every kernel unpacks the integer codes with uint8 ops, converts them into ``out`` with
# ``copy_`` and applies the scales with in-place ``mul_``/``sub_``/``add_``: the same fp32
# operations, in the same order, as gguf.quants (so the same bits), without the slow
# mixed-dtype broadcasting kernels and without fresh full-size temporaries.


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as an fp32 column ``(n, 1)``."""
    # Every block size is even and every fp16 field 2-aligned: view the rows as fp16 words.
    return blocks.view(torch.float16)[:, start // 2:start // 2 + 1].to(torch.float32)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Split every byte into its ``8 // bits`` fields of ``bits`` bits, lowest field first,
    along a new axis inserted at ``dim`` (shifts by Python ints: the vectorised kernels)."""
    fields = 8 // bits
    dim = dim % (packed.dim() + 1)
    shape = (*packed.shape[:dim], fields, *packed.shape[dim:])
    out = torch.empty(shape, dtype=torch.uint8, device=packed.device)
    for i in range(fields):
        torch.bitwise_right_shift(packed, i * bits, out=out.select(dim, i))
    if fields > 1:  # every field but the top one still carries the bits above it
        out &= (1 << bits) - 1
    return out


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes ``(n, m)`` -> ``(n, 2, m)``: low nibbles, then high nibbles."""
    return _unpack(qs, 4, 1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """Bytes ``(n, m)`` -> ``(n, 8, m)``: bit ``i`` of every byte in row ``i``."""
    return _unpack(qh, 1, 1)


def _little_endian_bits(word: torch.Tensor) -> torch.Tensor:
    """A little-endian 32-bit word as 4 bytes ``(n, 4)`` -> its 32 bits ``(n, 32)``, bit 0 first."""
    return _unpack(word, 1, -1).reshape(word.shape[0], 32)


def _q8_0(b, out):
    out.copy_(b[:, 2:].view(torch.int8))
    out.mul_(_f16(b, 0))


def _q4_0(b, out):
    out.copy_(_nibbles(b[:, 2:]).view(-1, 32).view(torch.int8) - 8)
    out.mul_(_f16(b, 0))


def _q4_1(b, out):
    out.copy_(_nibbles(b[:, 4:]).view(-1, 32))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5(b, offset):
    high = _little_endian_bits(b[:, offset:offset + 4])
    low = _nibbles(b[:, offset + 4:]).view(-1, 32)
    return low | (high << 4)


def _q5_0(b, out):
    out.copy_(_q5(b, 2).view(torch.int8) - 16)
    out.mul_(_f16(b, 0))


def _q5_1(b, out):
    out.copy_(_q5(b, 4))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q2_k(b, out):
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    # 2-bit codes: byte j of each 32-byte half holds elements j, j+32, j+64, j+96 of that half.
    q = _unpack(qs.reshape(n, 2, 32), 2, 2)
    o = out.view(n, 16, 16)
    o.copy_(q.view(n, 16, 16))
    o.mul_(dl).sub_(ml)


def _q3_k(b, out):
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 signed 6-bit scales: low 4 bits in bytes 0-7 (two per byte), high 2 bits in bytes 8-11.
    low = _unpack(packed[:, :8], 4, 1).reshape(n, 16)
    high = _unpack(packed[:, 8:], 2, 1).reshape(n, 16)
    scales = (low | (high << 4)).view(torch.int8) - 32
    dl = (d * scales.to(torch.float32)).view(n, 16, 1)
    ql = _unpack(qs.reshape(n, 2, 32), 2, 2)
    qh = _bits(hmask).view(n, 16, 16) ^ 1  # a set mask bit means "no offset of -4"
    o = out.view(n, 16, 16)
    o.copy_(ql.view(n, 16, 16).view(torch.int8) - (qh << 2).view(torch.int8))
    o.mul_(dl)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K super-block (12 bytes)."""
    n = packed.shape[0]
    d, m, md = packed.reshape(n, 3, 4).unbind(1)
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scales, mins


def _k_affine(b, q, out):
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k_scales_mins(b[:, 4:16])
    o = out.view(n, 8, 32)
    o.copy_(q)
    o.mul_((d * scales.to(torch.float32)).view(n, 8, 1))
    o.sub_((dmin * mins.to(torch.float32)).view(n, 8, 1))


def _q4_k(b, out):
    n = b.shape[0]
    # Each 32-byte group holds 64 values: 32 in the low nibbles, then 32 in the high nibbles.
    q = _unpack(b[:, 16:].reshape(n, 4, 32), 4, 2)
    _k_affine(b, q.view(n, 8, 32), out)


def _q5_k(b, out):
    n = b.shape[0]
    low = _unpack(b[:, 48:].reshape(n, 4, 32), 4, 2)
    high = _bits(b[:, 16:48])
    _k_affine(b, low.view(n, 8, 32) | (high << 4), out)


def _q6_k(b, out):
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    low = _unpack(ql.reshape(n, 2, 64), 4, 2)
    high = _unpack(qh.reshape(n, 2, 32), 2, 2)
    q = (low.view(n, 8, 32) | (high.view(n, 8, 32) << 4)).view(torch.int8) - 32
    o = out.view(n, 16, 16)
    o.copy_(q.view(n, 16, 16))
    o.mul_((d * scales.view(torch.int8).to(torch.float32)).view(n, 16, 1))


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_lookup(codes: torch.Tensor, out: torch.Tensor):
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=codes.device)
    torch.index_select(table, 0, codes.reshape(-1).to(torch.int32), out=out.view(-1))


def _iq4_nl(b, out):
    _iq4_lookup(_nibbles(b[:, 2:]), out)
    out.mul_(_f16(b, 0))


def _iq4_xs(b, out):
    n = b.shape[0]
    d = _f16(b, 0)
    high_word = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # 8 x 2 bits
    high = (high_word >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    low = _nibbles(b[:, 4:8]).transpose(1, 2).reshape(n, 8)  # sub-block j: nibble j % 2 of byte j // 2
    scales = (low.to(torch.int32) | (high << 4)) - 32
    _iq4_lookup(_nibbles(b[:, 8:].reshape(n * 8, 16)), out)
    out.view(n, 8, 32).mul_((d * scales.to(torch.float32)).view(n, 8, 1))


KERNELS = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}


# Fast paths for the common types: the per-block scales are computed once for all blocks,
# and the chunk loop only unpacks codes, writing each bit field straight into a strided
# view of the fp32 output (no interleaving copies), then applies the scales in place.

def _chunked_q8_0(b, out, step):
    d = _f16(b, 0)
    codes = b[:, 2:].view(torch.int8)
    for s in range(0, b.shape[0], step):
        out[s:s + step].copy_(codes[s:s + step]).mul_(d[s:s + step])


def _chunked_q4_k(b, out, step):
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scales, mins = _k_scales_mins(b[:, 4:16])
    dl = (d * scales.to(torch.float32)).view(n, 8, 1)
    ml = (dmin * mins.to(torch.float32)).view(n, 8, 1)
    codes = b[:, 16:]
    for s in range(0, n, step):
        qs = codes[s:s + step].reshape(-1, 4, 32)
        o = out[s:s + step].view(-1, 4, 2, 32)
        o[:, :, 0].copy_(qs & 0x0F)
        o[:, :, 1].copy_(qs >> 4)
        o.view(-1, 8, 32).mul_(dl[s:s + step]).sub_(ml[s:s + step])


def _chunked_q6_k(b, out, step):
    n = b.shape[0]
    dl = (_f16(b, 208) * b[:, 192:208].view(torch.int8).to(torch.float32)).view(n, 16, 1)
    for s in range(0, n, step):
        chunk = b[s:s + step]
        ql = chunk[:, :128].reshape(-1, 2, 2, 32)  # (half, bytes 0-31 / 32-63, 32)
        qh = chunk[:, 128:192].reshape(-1, 2, 32)
        low = (ql & 0x0F, ql >> 4)
        o = out[s:s + step].view(-1, 2, 4, 32)  # row 4·half + k of 32 values
        for k in range(4):
            # value = (low nibble | 2 high bits << 4) - 32, as int8
            q = low[k // 2][:, :, k % 2] | (((qh >> (2 * k)) & 3) << 4)
            o[:, :, k].copy_(q.view(torch.int8) - 32)
        o.view(-1, 16, 16).mul_(dl[s:s + step])


FAST_KERNELS = {"Q8_0": _chunked_q8_0, "Q4_K": _chunked_q4_k, "Q6_K": _chunked_q6_k}

# On the CPU, blocks are decoded in chunks of about this many values so that a chunk's
# temporaries stay in cache (and are recycled by the allocator instead of page-faulting).
# A GPU decodes everything in one pass of launches.
CPU_CHUNK_VALUES = 1 << 18


def dequantize_blocks(blocks: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """GGML blocks of type ``qtype`` -> the flat float values, in ``dtype``, on their device.

    ``blocks`` is uint8, ``(n_blocks, type_size)`` or any shape with that many bytes. ``out``
    (optional, contiguous, ``n_blocks * block_size`` values of ``dtype``) receives the result.
    """
    block_size, type_size = BLOCK_SIZES[qtype]
    blocks = blocks.reshape(-1, type_size)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(n * block_size, dtype=dtype, device=blocks.device)
    step = max(n, 1) if blocks.device.type != "cpu" else max(1, CPU_CHUNK_VALUES // block_size)
    # Decoded in fp32 (exact), rounded once into the compute dtype.
    flat = out if dtype == torch.float32 else torch.empty(n * block_size, device=blocks.device)
    flat = flat.view(n, block_size)
    if qtype in FAST_KERNELS:
        FAST_KERNELS[qtype](blocks, flat, step)
    else:
        for start in range(0, n, step):
            KERNELS[qtype](blocks[start:start + step], flat[start:start + step])
    if dtype != torch.float32:
        out.view(n, block_size).copy_(flat)
    return out.view(-1)


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
