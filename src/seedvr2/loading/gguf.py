"""GGUF weight files: read with the ``gguf`` package, dequantised in torch on the device.

Every tensor is a view of the memory-mapped file; quantised ones stay raw GGML blocks in a
:class:`~.packed.PackedWeight` (scheme ``gguf``). :func:`dequantize_blocks` follows
``gguf.quants``' float operations, bit-for-bit in fp32. docs/models.md, "GGUF"."""

from __future__ import annotations

import functools
import json
import math
import mmap
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .packed import Format, Part, PackedEntry, PackedWeight, Scheme, device_constant, register
from .source import COMFY_PREFIX, CheckpointError, TensorSource


# GGML type name -> (values per block, bytes per block)
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
}
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED_TYPES = (*PLAIN_TYPES, *BLOCK_SIZES)

ORIG_SHAPE_KEY = "comfy.gguf.orig_shape."
CONFIG_KEY = "seedvr2.config"


# ---------------------------------------------------------------------------------------------
# dequantisation: blocks (n, type_size) uint8 -> out (n, block_size) float32, in gguf.quants'
# order of fp32 operations; the CPU layout and why: docs/models.md, "GGUF".


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as an fp32 column ``(n, 1)``."""
    # Every block size is even and every fp16 field 2-aligned: view the rows as fp16 words.
    return blocks.view(torch.float16)[:, start // 2].to(torch.float32).unsqueeze(1)


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


class _Scratch:
    """Flat buffers that every chunk decoded by one thread reuses."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self.views: dict[tuple, object] = {}  # (name, shape, dtype) -> view of a buffer

    def get(self, key, make):
        """``make()``, built once per key (a type and a chunk size: the views of its buffers)."""
        value = self.views.get(key)
        if value is None:
            value = self.views[key] = make()
        return value

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        view = self.views.get((name, shape, dtype))
        if view is not None:
            return view
        numel = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self.buffers[name] = torch.empty(numel, dtype=dtype, device=self.device)
        view = self.views[(name, shape, dtype)] = buffer[:numel].view(shape)
        return view


@functools.lru_cache(maxsize=64)
def _shifts(values: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """Per-field shift amounts, shaped to broadcast along an outer axis of the codes."""
    return torch.tensor(values, dtype=dtype, device=device).view(shape)


def _fields(b, start: int, stop: int) -> torch.Tensor:
    """Bytes ``start:stop`` of every block, compact ``(n, stop - start)``: one copy reads each
    block's cache line once, and the scale arithmetic runs on the copy."""
    return b[:, start:stop].clone(memory_format=torch.contiguous_format)


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous ``x.t()`` (``contiguous()`` may keep odd strides when ``n`` is 1)."""
    return torch.empty(x.shape[::-1], dtype=x.dtype, device=x.device).copy_(x.t())


# Every type is a pair: ``scales(b)``, the per-block (per-sub-block) scale tensors of blocks
# ``b``, block first (None: the type has none); ``decode(b, out, scales, scratch)`` writes
# blocks ``b`` into ``out`` (contiguous fp32 ``(n, block_size)``) given those scales (sliced to
# the same blocks), temporaries in ``scratch`` (the calling thread's :class:`_Scratch`).


def _q4_0(b, out, scales, scratch):
    out.copy_(_nibbles(b[:, 2:]).view(-1, 32).view(torch.int8) - 8)
    out.mul_(_f16(b, 0))


def _q4_1(b, out, scales, scratch):
    out.copy_(_nibbles(b[:, 4:]).view(-1, 32))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5(b, offset):
    # The little-endian 32-bit word of high bits, as 4 bytes -> its 32 bits, bit 0 first.
    high = _unpack(b[:, offset:offset + 4], 1, -1).reshape(b.shape[0], 32)
    low = _nibbles(b[:, offset + 4:]).view(-1, 32)
    return low | (high << 4)


def _q5_0(b, out, scales, scratch):
    out.copy_(_q5(b, 2).view(torch.int8) - 16)
    out.mul_(_f16(b, 0))


def _q5_1(b, out, scales, scratch):
    out.copy_(_q5(b, 4))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_lookup(codes: torch.Tensor, out: torch.Tensor):
    table = device_constant(IQ4_VALUES, torch.float32, codes.device)  # made once per device
    torch.index_select(table, 0, codes.reshape(-1).to(torch.int32), out=out.view(-1))


def _iq4_nl(b, out, scales, scratch):
    _iq4_lookup(_nibbles(b[:, 2:]), out)
    out.mul_(_f16(b, 0))


def _iq4_xs(b, out, scales, scratch):
    n = b.shape[0]
    d = _f16(b, 0)
    high_word = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # 8 x 2 bits
    high = (high_word >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    low = _nibbles(b[:, 4:8]).transpose(1, 2).reshape(n, 8)  # sub-block j: nibble j % 2 of byte j // 2
    scales = (low.to(torch.int32) | (high << 4)) - 32
    _iq4_lookup(_nibbles(b[:, 8:].reshape(n * 8, 16)), out)
    out.view(n, 8, 32).mul_((d * scales.to(torch.float32)).view(n, 8, 1))


def _q8_0_scales(b):
    return (_f16(b, 0),)


def _q8_0(b, out, scales, scratch):
    out.copy_(b[:, 2:].view(torch.int8)).mul_(scales[0])


def _k_scales(b):
    """Q4_K/Q5_K: d * scale and dmin * min of every 32-value sub-block, ``(n, 8, 1)`` each.
    Bytes 4-15 hold 8 six-bit scales and 8 six-bit mins: scale i < 4 is the low 6 bits of byte
    i, min i < 4 those of byte i + 4; for i >= 4 the low (scale) or high (min) nibble of byte
    i + 4, with bits 4-5 from the top 2 bits of byte i - 4 (scale) or i (min). Computed on
    32-bit words, four bytes per lane, transposed so that every op runs over rows of ``n``."""
    n = b.shape[0]
    words = _transposed(_fields(b, 0, 16).view(torch.int32))  # (4, n): d|dmin, then 12 bytes
    both = torch.empty(2, n, 2, dtype=torch.int32, device=b.device)  # (scale/min, block, i // 4)
    torch.bitwise_and(words[1:3], 0x3F3F3F3F, out=both[:, :, 0])
    low = words[3:] >> _shifts((0, 4), (2, 1), torch.int32, b.device)
    low &= 0x0F0F0F0F
    high = words[1:3] >> 2
    high &= 0x30303030
    torch.bitwise_or(low, high, out=both[:, :, 1])
    rows = both.view(torch.uint8).view(2, n, 8).to(torch.float32)
    d = words[0].view(torch.float16).view(n, 2).t().to(torch.float32)  # (2, n): d, dmin
    rows *= d.unsqueeze(-1)
    return rows[0].unsqueeze(-1), rows[1].unsqueeze(-1)


def _q4_k(b, out, scales, scratch):
    # 128 code bytes in 4 groups of 32; sub-block 2 g + h holds nibble h of group g's bytes.
    c = b.shape[0]

    def make():
        q = scratch("q", (2, c, 32), torch.int32)  # (nibble, block, word)
        return q, q.view(torch.uint8).view(2, c, 4, 32), _shifts((0, 4), (2, 1, 1), torch.int32,
                                                                  b.device)
    q, q_bytes, nibble = scratch.get(("Q4_K", c), make)
    torch.bitwise_right_shift(b[:, 16:].view(torch.int32), nibble, out=q)
    q &= 0x0F0F0F0F
    o = out.view(c, 4, 2, 32)  # (block, group, nibble, byte)
    o.permute(2, 0, 1, 3).copy_(q_bytes)
    dl, ml = scales
    o.view(c, 8, 32).mul_(dl).sub_(ml)


def _q5_k(b, out, scales, scratch):
    # As Q4_K, plus a fifth bit: bit r of byte j of the 32 qh bytes belongs to sub-block r.
    c = b.shape[0]

    def make():
        groups = scratch("t", (4, c, 8), torch.int32)
        q = scratch("q", (4, 2, c * 8), torch.int32)  # (group, nibble, block x word)
        high = scratch("qh", (c, 8), torch.int32)
        h = scratch("h", (8, c * 8), torch.int32)  # (sub-block, block x word)
        return (groups, groups.view(4, 1, -1), q, q.view(8, -1), q.view(torch.uint8).view(8, c, 32),
                high, high.view(1, -1), h, _shifts((0, 4), (1, 2, 1), torch.int32, b.device),
                _shifts(tuple(range(8)), (8, 1), torch.int32, b.device))
    groups, groups_row, q, codes, code_bytes, high, high_row, h, nibble, row = \
        scratch.get(("Q5_K", c), make)
    groups.copy_(b[:, 48:].view(torch.int32).view(c, 4, 8).transpose(0, 1))
    torch.bitwise_right_shift(groups_row, nibble, out=q)
    q &= 0x0F0F0F0F
    high.copy_(b[:, 16:48].view(torch.int32))
    torch.bitwise_right_shift(high_row, row, out=h)
    h &= 0x01010101
    torch.add(codes, h, alpha=16, out=codes)  # no carries: every byte stays < 32
    o = out.view(c, 8, 32)
    o.transpose(0, 1).copy_(code_bytes)
    dl, ml = scales
    o.mul_(dl).sub_(ml)


def _q6_k_scales(b):
    tail = _fields(b, 192, 210)  # 16 int8 scales, fp16 d
    return ((tail[:, :16].view(torch.int8).to(torch.float32) * _f16(tail, 16)).unsqueeze(-1),)


def _q6_k(b, out, scales, scratch):
    # Halves of 128 values; in half k, row r is nibble r // 2 of ql bytes 64 k + 32 (r % 2) + j,
    # plus bits 2r, 2r + 1 of qh byte 32 k + j as bits 4-5, minus 32 (16-bit words: 210-byte block).
    c = b.shape[0]

    def make():
        packed = scratch("ql", (c * 2, 2, 16), torch.int16)  # (block x half, r % 2, word)
        low = scratch("t", (2, c * 2, 16), torch.int16)  # (r % 2, block x half, word)
        q = scratch("q", (2, 2, c * 32), torch.int16)  # (r // 2, r % 2, block x half x word)
        high = scratch("qh", (c, 32), torch.int16)
        h = scratch("h", (4, c * 32), torch.int16)  # (r, block x half x word)
        codes = q.view(torch.int8).view(4, -1)
        return (packed.view(c, 64), packed.transpose(0, 1), low, low.view(1, 2, -1), q, high,
                high.view(1, -1), h, h.view(torch.int8), codes, codes.view(4, c, 2, 32),
                _shifts((0, 4), (2, 1, 1), torch.int16, b.device),
                _shifts((0, 2, 4, 6), (4, 1), torch.int16, b.device))
    (packed, packed_t, low, low_rows, q, high, high_row, h, h8, codes, codes_out, nibble,
     row) = scratch.get(("Q6_K", c), make)
    words = b.view(torch.int16)
    packed.copy_(words[:, :64])
    low.copy_(packed_t)
    torch.bitwise_right_shift(low_rows, nibble, out=q)
    q &= 0x0F0F
    high.copy_(words[:, 64:96])
    torch.bitwise_right_shift(high_row, row, out=h)
    h &= 0x0303
    # As bytes (int8): code - 32 = low nibble + 16 (high bits - 2), within -32..31.
    h8 -= 2
    torch.add(codes, h8, alpha=16, out=codes)
    out.view(c, 2, 4, 32).permute(2, 0, 1, 3).copy_(codes_out)  # (block, half, r, value)
    out.view(c, 16, 16).mul_(scales[0])


def _q3_k_scales(b):
    n = b.shape[0]
    tail = _fields(b, 96, 110)
    # 16 signed 6-bit scales: low 4 bits in bytes 0-7 (two per byte), high 2 bits in bytes 8-11.
    low = _unpack(tail[:, :8], 4, 1).reshape(n, 16)
    high = _unpack(tail[:, 8:12], 2, 1).reshape(n, 16)
    high <<= 4
    low |= high
    scales = low.view(torch.int8).to(torch.float32)
    scales -= 32  # exact, like gguf.quants' int8 subtraction
    return ((_f16(tail, 12) * scales).unsqueeze(-1),)


def _q3_k(b, out, scales, scratch):
    # Two halves of 128 values; in half k, row r (32 values) is: bits 2r, 2r + 1 of qs byte
    # 32 k + j, minus 4 unless bit 4 k + r of hmask byte j is set (16-bit words: 110 bytes).
    c = b.shape[0]

    def make():
        halves = scratch("t", (2, c, 16), torch.int16)
        q = scratch("q", (2, 4, c * 16), torch.int16)  # (half, r, block x word)
        mask = scratch("qh", (c, 16), torch.int16)
        h = scratch("h", (8, c * 16), torch.int16)  # (4 half + r, block x word)
        codes = q.view(torch.int8).view(8, -1)
        return (halves, halves.view(2, 1, -1), q, mask, mask.view(1, -1), h, h.view(torch.int8),
                codes, codes.view(8, c, 32),
                _shifts((0, 2, 4, 6), (1, 4, 1), torch.int16, b.device),
                _shifts(tuple(range(8)), (8, 1), torch.int16, b.device))
    (halves, halves_rows, q, mask, mask_row, h, h8, codes, codes_out, pair,
     row) = scratch.get(("Q3_K", c), make)
    words = b.view(torch.int16)
    halves.copy_(words[:, 16:48].view(c, 2, 16).transpose(0, 1))
    torch.bitwise_right_shift(halves_rows, pair, out=q)
    q &= 0x0303
    mask.copy_(words[:, :16])
    torch.bitwise_right_shift(mask_row, row, out=h)
    h &= 0x0101
    # As bytes (int8), like gguf.quants: code = low 2 bits - 4 (1 - mask bit), within -4..3.
    h8 -= 1
    torch.add(codes, h8, alpha=4, out=codes)
    out.view(c, 8, 32).transpose(0, 1).copy_(codes_out)
    out.view(c, 16, 16).mul_(scales[0])


def _q2_k_scales(b):
    # Sub-blocks of 16 values: scale and min are the low and high nibble of scale byte i.
    n = b.shape[0]
    packed = _fields(b, 0, 16).view(torch.int32)
    d = _fields(b, 80, 84)
    low = packed & 0x0F0F0F0F
    dl = low.view(torch.uint8).to(torch.float32) * _f16(d, 0)
    packed >>= 4
    packed &= 0x0F0F0F0F
    ml = packed.view(torch.uint8).to(torch.float32) * _f16(d, 2)
    return dl.view(n, 16, 1), ml.view(n, 16, 1)


def _q2_k(b, out, scales, scratch):
    # Two halves of 128 values; in half k, row r is bits 2r, 2r + 1 of qs byte 32 k + j.
    c = b.shape[0]

    def make():
        halves = scratch("t", (2, c, 8), torch.int32)
        q = scratch("q", (2, 4, c * 8), torch.int32)  # (half, r, block x word)
        return (halves, halves.view(2, 1, -1), q, q.view(torch.uint8).view(8, c, 32),
                _shifts((0, 2, 4, 6), (1, 4, 1), torch.int32, b.device))
    halves, halves_rows, q, code_bytes, pair = scratch.get(("Q2_K", c), make)
    halves.copy_(b[:, 16:80].view(torch.int32).view(c, 2, 8).transpose(0, 1))
    torch.bitwise_right_shift(halves_rows, pair, out=q)
    q &= 0x03030303
    out.view(c, 8, 32).transpose(0, 1).copy_(code_bytes)
    dl, ml = scales
    out.view(c, 16, 16).mul_(dl).sub_(ml)


# GGML type name -> (scales, decode)
KERNELS = {
    "Q8_0": (_q8_0_scales, _q8_0), "Q4_0": (None, _q4_0), "Q4_1": (None, _q4_1),
    "Q5_0": (None, _q5_0), "Q5_1": (None, _q5_1),
    "Q2_K": (_q2_k_scales, _q2_k), "Q3_K": (_q3_k_scales, _q3_k), "Q4_K": (_k_scales, _q4_k),
    "Q5_K": (_k_scales, _q5_k), "Q6_K": (_q6_k_scales, _q6_k),
    "IQ4_NL": (None, _iq4_nl), "IQ4_XS": (None, _iq4_xs),
}

# CPU scheduling: one thread decodes cache-sized chunks; several share them out to Python
# threads, every op under torch's grain size (no OpenMP barrier). A GPU decodes all at once.
CPU_CHUNK_VALUES = 1 << 17
THREAD_CHUNK_VALUES = 32768 - 256  # a multiple of 256, below the grain size
MAX_SCALES_PER_BLOCK = 32  # elements per block in the largest op of a ``scales`` function
MAX_CPU_WORKERS = 8


def _schedule(n: int, block_size: int, device: torch.device) -> tuple[int, int, int]:
    """(blocks per chunk, blocks per run of chunks sharing one scales call, threads)."""
    if device.type != "cpu":
        return n, n, 1
    threads = torch.get_num_threads()
    if threads == 1:
        return max(1, CPU_CHUNK_VALUES // block_size), n, 1
    step = max(1, min(CPU_CHUNK_VALUES, THREAD_CHUNK_VALUES) // block_size)
    run = max(1, THREAD_CHUNK_VALUES // MAX_SCALES_PER_BLOCK // step) * step
    workers = min(threads, MAX_CPU_WORKERS, n // (2 * step), -(-n // run))
    return step, run, max(1, workers)


def dequantize_blocks(blocks: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """GGML blocks of type ``qtype`` -> the flat float values, in ``dtype``, on their device.
    ``blocks`` is uint8, ``(n_blocks, type_size)`` or any shape with that many bytes. ``out``
    (optional, contiguous, ``n_blocks * block_size`` values of ``dtype``) receives the result."""
    block_size, type_size = BLOCK_SIZES[qtype]
    blocks = blocks.reshape(-1, type_size)
    if not blocks.is_contiguous() or blocks.storage_offset() % 4:
        # The kernels view fields as 16/32-bit words: whole, aligned rows.
        blocks = blocks.clone(memory_format=torch.contiguous_format)
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(n * block_size, dtype=dtype, device=blocks.device)
    flat = out.view(n, block_size)
    if n == 0:
        return out.view(-1)
    scales_of, decode = KERNELS[qtype]
    step, run, workers = _schedule(n, block_size, blocks.device)

    def work(first: int, last: int):
        scratch = _Scratch(blocks.device)
        for run_start in range(first, last, run):
            run_stop = min(last, run_start + run)
            scales = scales_of(blocks[run_start:run_stop]) if scales_of else ()
            for start in range(run_start, run_stop, step):
                stop = min(run_stop, start + step)
                part = tuple(s[start - run_start:stop - run_start] for s in scales)
                if dtype == torch.float32:
                    decode(blocks[start:stop], flat[start:stop], part, scratch)
                else:  # decoded in fp32 (exact), rounded once into the compute dtype
                    values = scratch("values", (stop - start, block_size), torch.float32)
                    decode(blocks[start:stop], values, part, scratch)
                    flat[start:stop].copy_(values)

    if workers == 1:
        work(0, n)
        return out.view(-1)
    # Contiguous shares of whole runs; worker threads start with default grad/inference modes.
    runs = -(-n // run)
    bounds = [min(n, runs * i // workers * run) for i in range(workers + 1)]
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def share(first: int, last: int):
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            work(first, last)

    with ThreadPoolExecutor(workers - 1) as pool:
        done = [pool.submit(share, bounds[i], bounds[i + 1]) for i in range(1, workers)]
        work(bounds[0], bounds[1])
        for future in done:
            future.result()
    return out.view(-1)


# Byte offsets of each type's fp16 scale fields: a block's only values that can be NaN or inf.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "IQ4_NL": (0,), "IQ4_XS": (0,)}


def _non_finite_scales(blocks: torch.Tensor, params) -> torch.Tensor:
    qtype = str(params["qtype"])
    rows = blocks.reshape(-1, BLOCK_SIZES[qtype][1])
    found = torch.zeros((), dtype=torch.bool, device=blocks.device)
    for offset in FP16_FIELDS[qtype]:
        scales = rows[:, offset:offset + 2].contiguous().view(torch.float16)
        found = found | ~torch.isfinite(scales).all()
    return found


def _dequantize(w: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_blocks(w.parts["blocks"], str(w.params["qtype"]), dtype).reshape(w.shape)


register(Format("gguf", (Scheme(
    "gguf", parts={"blocks": Part((torch.uint8,), lambda shape, params: [],
                                  non_finite=_non_finite_scales)},
    dequantize=_dequantize, label=lambda params, dtypes: str(params["qtype"])),),
    bytes_per_weight={**{qtype: size / block for qtype, (block, size) in BLOCK_SIZES.items()},
                      **{name: dtype.itemsize for name, dtype in PLAIN_TYPES.items()}}))


# ---------------------------------------------------------------------------------------------
# reading


# GGUF metadata value types -> size in bytes (8: string, 9: array)
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# Arrays of arrays and of strings are walked an item at a time (by the gguf package too, at
# ~10 us each): bounded, far above the few a model file holds (tokenizers aside).
MAX_ARRAY_DEPTH, MAX_WALKED_ITEMS = 4, 1 << 16


class _Damaged(Exception):
    """A header field that cannot be what it declares (caught in _check_header)."""


@dataclass
class _HeaderWalk:
    """A cursor over a GGUF header in Python integers, every read checked against the file's end."""

    data: object  # the mapped file
    size: int
    order: str  # struct's byte order, "<" or ">"
    pos: int = 8
    walked: int = 0  # strings and arrays walked inside arrays so far

    def need(self, n: int, what: str):
        if n > self.size - self.pos:
            raise _Damaged(f"{what}: {n} bytes declared at byte {self.pos}, "
                           f"{self.size - self.pos} left")

    def take(self, fmt: str, what: str) -> int:
        self.need(struct.calcsize(fmt), what)
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, what: str) -> str:
        length = self.take("Q", what)
        self.need(length, what)
        self.pos += length
        try:
            return bytes(self.data[self.pos - length:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"{what}: not UTF-8") from None

    def skip(self, value_type: int, what: str, depth: int = 0):
        """Past one metadata value of ``value_type``."""
        if value_type in _GGUF_SCALAR_SIZES:
            self.need(_GGUF_SCALAR_SIZES[value_type], what)
            self.pos += _GGUF_SCALAR_SIZES[value_type]
        elif value_type == 8:
            self.string(what)
        elif value_type == 9 and depth < MAX_ARRAY_DEPTH:
            self.skip_array(what, depth)
        else:
            raise _Damaged(f"{what}: value type {value_type}"
                           f"{' nested too deeply' if value_type == 9 else ''}")

    def skip_array(self, what: str, depth: int):
        item, count = self.take("I", what), self.take("Q", what)
        least = _GGUF_SCALAR_SIZES.get(item, {8: 8, 9: 12}.get(item, 0))
        self.need(count * least, f"{what}: an array of {count} items")
        if item in _GGUF_SCALAR_SIZES:
            self.pos += count * least
            return
        self.walked += count
        if self.walked > MAX_WALKED_ITEMS:
            raise _Damaged(f"{what}: more than {MAX_WALKED_ITEMS} strings or arrays in arrays "
                           f"(a SeedVR2 model holds a few)")
        for _ in range(count):
            self.skip(item, what, depth + 1)

    def alignment(self, n_fields: int) -> int:
        """Past the metadata: its ``general.alignment`` (32 when absent)."""
        alignment = 32
        for _ in range(n_fields):
            key = self.string("a metadata key")
            value_type = self.take("I", f"metadata {key!r}")
            self.skip(value_type, f"metadata {key!r}")
            if key == "general.alignment" and value_type == 4:
                alignment = struct.unpack_from(self.order + "I", self.data, self.pos - 4)[0]
        return alignment

    def tensor_infos(self, n_tensors: int) -> list[tuple[str, list[int], int, int]]:
        """Past the tensor infos: each tensor's ``(name, dims, type id, offset)``."""
        infos = []
        for i in range(n_tensors):
            name = self.string(f"tensor {i}'s name")
            what = f"tensor {name!r}"
            dims = [self.take("Q", what) for _ in range(self.take("I", what))]
            infos.append((name, dims, self.take("I", what), self.take("Q", what)))
        return infos


def _check_header(path: Path, gguf) -> None:
    """Walk the header in Python integers before the gguf package reads it, which trusts every
    count (2^24 array items declared in 16 bytes are walked one by one) and adds offsets in
    numpy uint64 (near 2^64 they wrap onto other bytes). GGUF v2/v3, either byte order; what
    is refused, naming the field: docs/models.md, "GGUF"."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        if bytes(m[:4]) != b"GGUF" or size < 24:
            raise _Damaged("no GGUF header")
        walk = _HeaderWalk(m, size, "<" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF else ">")
        n_tensors, n_fields = walk.take("Q", "tensor count"), walk.take("Q", "metadata count")
        walk.need(n_fields * 12 + n_tensors * 24,
                  f"{n_fields} metadata fields, {n_tensors} tensors")
        alignment = walk.alignment(n_fields)
        infos = walk.tensor_infos(n_tensors)
        if alignment <= 0 or alignment & (alignment - 1):
            raise _Damaged(f"metadata 'general.alignment': {alignment}, not a power of two")
        _check_tensors(path, gguf, infos, -(-walk.pos // alignment) * alignment, alignment, size)
    except _Damaged as e:
        raise CheckpointError(f"{path}: unreadable GGUF file, truncated or corrupt ({e})") \
            from None
    finally:
        if size:
            m.close()


def _check_tensors(path: Path, gguf, infos, start: int, alignment: int, size: int) -> None:
    """Every tensor ``(name, dims, type id, offset)`` of a header whose data starts at byte
    ``start``: its type known, its bytes aligned, in the file and its own; its key unique."""
    keys, spans = {}, []
    for name, dims, type_id, offset in infos:
        key = name.removeprefix(COMFY_PREFIX)
        if key in keys:
            raise CheckpointError(f"{path}: tensors {keys[key]!r} and {name!r} are both "
                                  f"{key!r} (a model's tensors are named once)")
        keys[key] = name
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has GGML type id {type_id}, which the installed gguf "
                f"package does not know; update gguf, or re-quantise the file to one of "
                f"{', '.join(SUPPORTED_TYPES)}") from None
        begin = start + offset
        end = begin + math.prod(dims) * type_size // block
        if end > size:
            raise CheckpointError(f"{path}: truncated GGUF file (tensor {name!r} ends at byte "
                                  f"{end}, file has {size})")
        if offset % alignment:
            raise CheckpointError(f"{path}: corrupt GGUF file (tensor {name!r} starts at data "
                                  f"offset {offset}, not a multiple of the alignment {alignment})")
        spans += [(begin, end, name)] if end > begin else []
    for (_, end, first), (begin, _, second) in zip(sorted(spans), sorted(spans)[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: corrupt GGUF file (tensors {first!r} and {second!r} "
                                  f"share bytes {begin} to {end}; each tensor has its own)")


def open_gguf(path: Path) -> TensorSource:
    """A GGUF file as a :class:`TensorSource` (quantised tensors stay packed)."""
    reader = _reader(path)
    shapes, dtypes, packed = {}, {}, {}
    stored = {}  # key -> F32/F16/BF16 tensor, or the (n_blocks, type_size) uint8 GGML blocks
    for tensor in reader.tensors:
        name, qtype = tensor.name, tensor.tensor_type.name
        key = name.removeprefix(COMFY_PREFIX)
        if qtype not in SUPPORTED_TYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has GGML type {qtype}, which this "
                                  f"loader cannot dequantise (supported: "
                                  f"{', '.join(SUPPORTED_TYPES)})")
        shapes[key] = _shape(path, reader.fields, tensor)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about non-writable numpy arrays
            data = torch.from_numpy(tensor.data)
        if qtype in PLAIN_TYPES:
            if qtype == "BF16":  # the reader gives BF16 as raw bytes
                data = data.view(torch.uint8).reshape(-1).view(torch.bfloat16)
            stored[key] = data.reshape(shapes[key])
            dtypes[key] = PLAIN_TYPES[qtype]
        else:
            stored[key] = data.view(torch.uint8).reshape(-1, BLOCK_SIZES[qtype][1])
            dtypes[key] = torch.uint8
            packed[key] = PackedEntry("gguf", shapes[key], {"blocks": key}, params={"qtype": qtype})

    def read_packed(key: str) -> PackedWeight:
        return packed[key].read(stored.__getitem__)

    def get(key: str) -> torch.Tensor:
        return read_packed(key).dequantize(torch.float32) if key in packed else stored[key]

    return TensorSource(path, "gguf", shapes=shapes, dtypes=dtypes,
                        metadata=_metadata(path, reader.fields),
                        packed={k: v.label(dtypes) for k, v in packed.items()},
                        part_keys={k: dict(v.files) for k, v in packed.items()},
                        get=get, get_packed=read_packed, close=stored.clear)


def _reader(path: Path):
    """The gguf package's reader of ``path``, or one error naming what it could not read."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the 'gguf' package "
                              f"(pip install gguf)") from None
    _check_header(path, gguf)
    try:
        # Copy-on-write map: tensors are writable views for torch, the file is never changed.
        return gguf.GGUFReader(path, "c")
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors alike
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: unreadable GGUF file, truncated or corrupt "
                              f"({detail[:200]})") from None


def _shape(path: Path, fields, tensor) -> tuple[int, ...]:
    """A tensor's logical shape (its dims, or ComfyUI-GGUF's ``orig_shape``), checked against
    its number of values."""
    name = tensor.name
    shape = tuple(int(v) for v in reversed(tensor.shape.tolist()))
    if ORIG_SHAPE_KEY + name in fields:
        orig = _contents(path, fields[ORIG_SHAPE_KEY + name])
        if not isinstance(orig, list) or not all(isinstance(v, int) and v >= 0 for v in orig):
            raise CheckpointError(f"{path}: metadata {ORIG_SHAPE_KEY + name!r} must be an "
                                  f"array of whole numbers, got {orig!r}"[:300])
        shape = tuple(orig)
    numel = math.prod(shape)
    if numel != tensor.n_elements:
        raise CheckpointError(f"{path}: tensor {name!r} has {tensor.n_elements} values but "
                              f"its shape {list(shape)} needs {numel}")
    return shape


def _contents(path: Path, field):
    """A metadata field's value as the gguf package decodes it; a value it cannot decode (not
    UTF-8, damaged) is one error naming the field."""
    try:
        return field.contents()
    except Exception as e:  # UnicodeDecodeError, IndexError, ValueError from damaged bytes
        raise CheckpointError(f"{path}: metadata {field.name!r} cannot be read "
                              f"({type(e).__name__})") from None


def _metadata(path: Path, fields) -> dict[str, str]:
    metadata: dict[str, str] = {}
    if CONFIG_KEY in fields:
        config = _contents(path, fields[CONFIG_KEY])
        if not isinstance(config, str):
            raise CheckpointError(f"{path}: metadata {CONFIG_KEY!r} must be a JSON string")
        metadata["config"] = config
    arch = fields.get("general.architecture")
    if arch is not None:
        metadata["general.architecture"] = str(_contents(path, arch))
    return metadata


def config_json(config: dict) -> str:
    """The ``seedvr2.config`` value for a model config dict."""
    return json.dumps(config, sort_keys=True)
