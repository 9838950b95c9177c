"""Property-based hostile tests of weight-file headers built from a grammar (Hypothesis; the
invariant in tests/hostile.py).

tests/test_hostile_weights.py damages real files a field at a time; here headers are written
from scratch: GGUF metadata of every value type, arrays and arrays of arrays whose declared
counts disagree with the bytes present, tensor counts, dimensions, GGML types, offsets near
2^64, alignments, names with the ComfyUI prefix or a NUL; safetensors entries with any dtype,
shapes whose product overflows, offsets anywhere, keys that collide once the prefix is
stripped. Every file is opened as the loaders open it (``open_weights``) and described as
``seedvr2 inspect`` does, each within a bound: the outcome is one clean refusal naming the file
within seconds, or a source whose every tensor is read from its own bytes (the bytes its header
gives it, no two tensors sharing any).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from seedvr2.loading import describe
from seedvr2.loading.load import open_weights

from hostile import outcome, outcome_within

BOUND_S = 5.0  # "within a second or two" on an idle machine; room for a loaded 2-core one
PREFIX = "model.diffusion_model."
HUGE = (2 ** 24, 10 ** 6, 2 ** 32, 2 ** 63, 2 ** 64 - 1)



def few(n: int):
    """``n`` examples in the default (ci) profile; the long profile's own count otherwise."""
    return settings(max_examples=n) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" \
        else settings()


# ---------------------------------------------------------------------------------------------
# GGUF

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
# GGML type id -> (values per block, bytes per block): plain, quantised, one the loader cannot
# dequantise (Q8_1), and ids no gguf package knows.
GGML = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18), 12: (256, 144), 9: (32, 36)}
NAMES = ("a.weight", PREFIX + "a.weight", "b.bias", PREFIX + "b.bias", "a\x00b", "é", "")


def _string(data: bytes, declared: int | None = None) -> bytes:
    return struct.pack("<Q", len(data) if declared is None else declared) + data


counts = st.integers(0, 3) | st.sampled_from(HUGE)


def gguf_payload(draw, kind: int, depth: int) -> tuple[bytes, bool]:
    """The bytes of one value of ``kind`` (no type tag), and whether they are what they
    declare (every count true)."""
    if kind in SCALARS:
        return draw(st.binary(min_size=struct.calcsize(SCALARS[kind]),
                              max_size=struct.calcsize(SCALARS[kind]))), True
    if kind == 8:
        text = draw(st.binary(max_size=6))
        declared = draw(st.none() | counts)
        return _string(text, declared), declared in (None, len(text))
    if kind == 9 and depth < 3:
        # (1-byte items first: a count past the file walks them to its end and beyond)
        item = draw(st.sampled_from([0, 7, 1, 4, 6, 10, 8, 9, 9, 2 ** 32 - 1]))
        n = draw(st.integers(0, 3))
        parts = [gguf_payload(draw, item, depth + 1) for _ in range(n)]
        declared = draw(st.none() | counts)
        honest = declared in (None, n) and all(ok for _, ok in parts) and \
            (item in SCALARS or item in (8, 9) or n == 0)
        return (struct.pack("<IQ", item, n if declared is None else declared)
                + b"".join(p for p, _ in parts)), honest and (item != 9 or depth < 2 or n == 0)
    return b"", False  # an unknown value type (or arrays nested too deep to write)


@st.composite
def gguf_files(draw):
    """(bytes, layout): a GGUF file and, when every declared count is true, ``layout``: each
    tensor's (name, absolute begin, bytes) by the header's own arithmetic; else None."""
    honest = True
    kvs = []
    alignment = 32
    for i in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from([*SCALARS, 8, 9, 9, 9, 9, 13]))
        payload, ok = gguf_payload(draw, kind, 0)
        honest &= ok
        kvs.append(_string(f"k{i}".encode()) + struct.pack("<I", kind) + payload)
    if draw(st.booleans()):  # general.alignment: any power of two, or not one, or another type
        value = draw(st.sampled_from([1, 8, 32, 64, 256, 0, 3]))
        kind = draw(st.sampled_from([4, 4, 4, 10]))
        kvs.append(_string(b"general.alignment") + struct.pack("<I" + SCALARS[kind], kind, value))
        honest &= kind == 4 and value > 0 and value & (value - 1) == 0
        alignment = value
    tensors = []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(NAMES) | st.text(max_size=4)).encode("utf-8", "surrogatepass")
        dims = draw(st.lists(st.integers(0, 64) | st.sampled_from(HUGE), max_size=3)
                    | st.lists(st.sampled_from([32, 64]), min_size=1, max_size=2))
        type_id = draw(st.sampled_from(sorted(GGML)) | st.sampled_from([99, 2 ** 32 - 1]))
        tensors.append([name, dims, type_id])
    layout, position = [], 0
    for name, dims, type_id in tensors:  # honest offsets, laid out one after the other
        block, size = GGML.get(type_id, (1, 1))
        n_bytes = math.prod(dims) * size // block
        tensors_offset = -(-position // max(alignment, 1)) * max(alignment, 1)
        layout.append([name, tensors_offset, n_bytes])
        position = tensors_offset + min(n_bytes, 1 << 16)
    for entry in layout:  # some offsets changed: near 2^64, onto another tensor, unaligned
        if draw(st.integers(0, 3)) == 0:
            entry[1] = draw(st.sampled_from([2 ** 64 - 1, 2 ** 64 - 32, 2 ** 63, 0, 1, 32]))
    declared_tensors = draw(st.none() | counts)
    declared_kvs = draw(st.none() | counts)
    honest &= declared_tensors in (None, len(tensors)) and declared_kvs in (None, len(kvs))
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if declared_tensors is None
                                   else declared_tensors,
                                   len(kvs) if declared_kvs is None else declared_kvs)
    header += b"".join(kvs)
    for (name, dims, type_id), (_, offset, _) in zip(tensors, layout):
        header += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id,
                                              offset)
    data_start = -(-len(header) // max(alignment, 1)) * max(alignment, 1) if honest else \
        len(header)
    slack = draw(st.integers(-64, 64))
    seed = draw(st.integers(0, 255))
    size = max(0, position + slack)
    data = (bytes(range(seed, 256)) + bytes(range(seed))) * (size // 256 + 1)
    data = data[:size]
    raw = header + bytes(data_start - len(header)) + data
    if not honest:
        return raw, None
    return raw, [(name, data_start + offset, n) for name, offset, n in layout]


def _tensor_bytes(source, key: str) -> bytes:
    if key in source.packed:
        blocks = source.get_packed(key).parts["blocks"]
        return blocks.reshape(-1).view(torch.uint8).numpy().tobytes()
    return source.get(key).reshape(-1).view(torch.uint8).numpy().tobytes()


def _key(name: str, names) -> str:
    stripped = any(n.startswith(PREFIX) for n in names)
    return name[len(PREFIX):] if stripped and name.startswith(PREFIX) else name


def described_and_opened(path: Path):
    """``seedvr2 inspect``'s description and the loaders' source, each within the bound:
    the source's outcome."""
    outcome_within(BOUND_S, lambda: describe(path), str(path))
    return outcome_within(BOUND_S, lambda: open_weights(path), str(path))


def check_gguf(path: Path, raw: bytes, layout) -> None:
    """Open and describe within the bound; an accepted file's every tensor is its own bytes."""
    opened = described_and_opened(path)
    if opened.refused:
        return
    with opened.value as source:
        if layout is None:  # counts that lie: a clean result is all that can be asked
            return
        names = [name.decode("utf-8") for name, _, _ in layout]
        keys = [_key(n, names) for n in names]
        assert len(set(keys)) == len(keys), f"tensors {names} collide as {keys}"
        spans = sorted((begin, begin + n, name) for name, begin, n in layout if n)
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            assert begin >= end, f"tensors {a!r} and {b!r} share bytes and were accepted"
        for (name, begin, n), key in zip(layout, keys):
            assert begin + n <= len(raw), f"tensor {name!r} lies past the end and was accepted"
            assert _tensor_bytes(source, key) == raw[begin:begin + n], \
                f"tensor {name!r} was read from other bytes than its own"


@few(200)  # about 1 s per 100 files
@given(gguf_files())
def test_gguf_headers_from_a_grammar(tmp_path_factory, file):
    pytest.importorskip("gguf")
    raw, layout = file
    path = tmp_path_factory.mktemp("gguf") / "grammar.gguf"
    path.write_bytes(raw)
    check_gguf(path, raw, layout)


@pytest.mark.parametrize("declared, present", [(2 ** 24, 16), (10 ** 6, 0)])
def test_a_gguf_array_longer_than_its_file_is_refused_at_once(tmp_path, declared, present):
    """An array of 2^24 uint32 declared with 16 bytes present (the gguf package walked it item
    by item: no answer in a minute), and 10^6 arrays declared inside one with none present."""
    pytest.importorskip("gguf")
    item = 4 if present else 9
    body = struct.pack("<IQ", item, declared) + bytes(present)
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string(b"tokens") + struct.pack("<I", 9) + body
    path = tmp_path / "long.gguf"
    path.write_bytes(raw)
    refused = outcome_within(BOUND_S, lambda: open_weights(path), str(path), "'tokens'")
    assert refused.refused and "bytes" in refused.message, refused.message


def _gguf(tensors, data: bytes, alignment: int = 32) -> bytes:
    """A GGUF of F32 tensors ``(name, dims, offset)`` and its data section."""
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 0)
    for name, dims, offset in tensors:
        header += _string(name.encode()) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims,
                                                       0, offset)
    return header + bytes(-len(header) % alignment) + data


def test_a_gguf_offset_near_2_64_is_refused_not_wrapped(tmp_path):
    """Offset 2^64 - 1 + the data start wrapped around in numpy's uint64 sum: the tensor was
    read from the file's first bytes, and the load succeeded."""
    pytest.importorskip("gguf")
    path = tmp_path / "wrap.gguf"
    path.write_bytes(_gguf([("a.weight", [4], 2 ** 64 - 1)], bytes(64)))
    refused = outcome(lambda: open_weights(path), str(path), "'a.weight'")
    assert refused.refused and "truncated" in refused.message, refused.message


def test_gguf_tensors_colliding_after_the_prefix_or_sharing_bytes_are_refused(tmp_path):
    pytest.importorskip("gguf")
    path = tmp_path / "twice.gguf"
    path.write_bytes(_gguf([("a.weight", [4], 0), (PREFIX + "a.weight", [4], 32)], bytes(64)))
    refused = outcome(lambda: open_weights(path), str(path), "'a.weight'",
                      f"'{PREFIX}a.weight'")
    assert refused.refused
    path.write_bytes(_gguf([("a.weight", [8], 0), ("b.weight", [4], 0)], bytes(64)))
    refused = outcome(lambda: open_weights(path), str(path), "'a.weight'", "'b.weight'")
    assert refused.refused and "share" in refused.message, refused.message


# ---------------------------------------------------------------------------------------------
# safetensors

ST_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
            "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@st.composite
def safetensors_files(draw):
    """(bytes, entries): a safetensors file and its entries ``name -> (begin, end)`` (data
    section offsets) as its header declares them."""
    entries, header, position = {}, {}, 0
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(NAMES) | st.text(max_size=4))
        dtype = draw(st.sampled_from(sorted(ST_SIZES)) | st.sampled_from(["F4", "f32", ""]))
        shape = draw(st.lists(st.integers(0, 8), max_size=3)
                     | st.lists(st.sampled_from(HUGE + (2 ** 64, 2 ** 70)), min_size=1,
                                max_size=3))
        size = math.prod(shape) * ST_SIZES.get(dtype, 1)
        begin, end = position, position + size
        if draw(st.integers(0, 3)) == 0:
            begin, end = draw(st.sampled_from([(0, size), (2 ** 64 - 1, 2 ** 64 - 1 + size),
                                               (position + 1, position + 1 + size),
                                               (end, begin), (0, 2 ** 64)]))
        if size <= 1 << 12:
            position = max(position, end if end <= 1 << 12 else position)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        entries[name] = (begin, end)
    raw_header = json.dumps(header).encode()
    slack = draw(st.sampled_from([0, 0, 0, -1, 1, 8]))
    data = (bytes(range(1, 254)) * (position // 253 + 2))[:max(0, position + slack)]
    return struct.pack("<Q", len(raw_header)) + raw_header + data, entries, len(raw_header)


@few(200)
@given(safetensors_files())
def test_safetensors_headers_from_a_grammar(tmp_path_factory, file):
    raw, entries, header_len = file
    path = tmp_path_factory.mktemp("st") / "grammar.safetensors"
    path.write_bytes(raw)
    opened = described_and_opened(path)
    if opened.refused:
        return
    with opened.value as source:
        names = list(entries)
        keys = {(_key(n, names) if all(m.startswith(PREFIX) for m in names) else n): n
                for n in names}
        assert len(keys) == len(names), f"tensors {names} collide"
        start = 8 + header_len
        for key, name in keys.items():
            if key in source.packed or key not in source.shapes:
                continue
            begin, end = entries[name]
            assert start + end <= len(raw), f"tensor {name!r} lies past the end, accepted"
            assert _tensor_bytes(source, key) == raw[start + begin:start + end], \
                f"tensor {name!r} was read from other bytes than its own"
