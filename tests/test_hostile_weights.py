"""Property-based hostile tests of weight files (Hypothesis; the invariant in tests/hostile.py).

Files are made from the tiny 3B DiT (and the tiny VAE) in every format the loader reads, then
damaged by the strategies below: ``comfy_quant`` markers of any JSON shape (and not JSON),
scale tensors of every dtype and shape, non-finite values in any tensor, safetensors headers
and metadata edited at random, and GGUF headers with any field changed. Each file goes through
every door a file enters by: ``seedvr2 inspect``, ``load_dit``/``load_vae``, ``seedvr2
quantize`` and the first forward pass (dequantising, and on the low-precision products a GPU of
compute capability 12.0 would take, each call checked against the kernels' preconditions). The
outcome is a correct result or one clean error naming the file (and the tensor, with what was
expected and what was found); what a file could make fail later is refused at load.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from seedvr2.loading import load_dit, load_vae

from conftest import constructor_kwargs
from hostile import outcome, run_cli

# safetensors dtype name -> (torch dtype, bytes per element)
ST_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
             "BF16": (torch.bfloat16, 2), "F8_E4M3": (torch.float8_e4m3fn, 1),
             "F8_E5M2": (torch.float8_e5m2, 1), "F8_E8M0": (torch.float8_e8m0fnu, 1),
             "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2),
             "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1)}
FLOATS = ("F32", "F16", "BF16")  # what a scale that multiplies may be stored as
SAFETENSORS_TARGETS = ("fp8_e4m3fn", "fp8_e5m2", "int8", "int8_convrot", "mxfp8", "nvfp4")
FLOAT_FILES = ("fp32", "fp16", "bf16")


def few(n: int):
    """``n`` examples in the default (ci) profile, whose whole suite has a time budget (each
    example here loads a model and runs it); the long profile's own count otherwise."""
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci":
        return settings(max_examples=n)
    return settings()


# ---------------------------------------------------------------------------------------------
# raw safetensors: entries name -> [dtype, shape, bytes], written back with consistent offsets


def read_raw(path: Path) -> tuple[dict, dict]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    metadata = header.pop("__metadata__", {})
    body = data[8 + length:]
    return {name: [e["dtype"], list(e["shape"]), body[e["data_offsets"][0]:e["data_offsets"][1]]]
            for name, e in header.items()}, metadata


def write_raw(path: Path, entries: dict, metadata: dict) -> Path:
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, blob) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def tensor_of(entry) -> torch.Tensor:
    dtype, shape, blob = entry
    torch_dtype, _ = ST_DTYPES[dtype]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(torch_dtype).reshape(shape)


def blob_of(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------------
# the files every strategy starts from


class Base(tuple):
    """(path, entries, metadata) of a base file; its repr is its name (the entries are MBs)."""

    def __repr__(self):
        return f"<{self[0].name}>"


class Bases(dict):
    def __repr__(self):
        return f"<bases: {', '.join(self)}>"


@pytest.fixture(scope="module")
def bases(conformance, tmp_path_factory) -> dict:
    """name -> (path, entries, metadata) of the tiny 3B DiT in fp32/fp16/bf16 and every
    safetensors quantize target, and of the tiny VAE."""
    from seedvr2.loading.quantize import quantize_file

    folder = tmp_path_factory.mktemp("hostile_weights")
    out = {}
    for name, family in (("fp32", "dit3b_tiny"), ("vae", "vae_tiny")):
        path = folder / f"{name}.safetensors"
        state = load_file(conformance / family / "weights.safetensors")
        save_file(state, path, metadata={"config": json.dumps(constructor_kwargs(
            conformance / family))})
        out[name] = path
    state = load_file(out["fp32"])
    metadata = read_raw(out["fp32"])[1]
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        out[name] = folder / f"{name}.safetensors"
        save_file({k: v.to(dtype) if not k.endswith("rope.freqs") else v
                   for k, v in state.items()}, out[name], metadata=metadata)
    for target in SAFETENSORS_TARGETS:
        out[target] = folder / f"{target}.safetensors"
        quantize_file(out["fp32"], out[target], target)
    return Bases({name: Base((path, *read_raw(path))) for name, path in out.items()})


class Raw(bytes):
    def __repr__(self):
        return f"<{len(self)} bytes>"


@pytest.fixture(scope="module")
def gguf_base(bases, tmp_path_factory) -> bytes:
    pytest.importorskip("gguf")
    from seedvr2.loading.quantize import quantize_file

    path = tmp_path_factory.mktemp("hostile_gguf") / "q8.gguf"
    quantize_file(bases["fp32"][0], path, "Q8_0")
    return Raw(path.read_bytes())


def _inputs():
    """A small DiT call: 4x4 latent tokens of one frame, 9 text tokens."""
    g = torch.Generator().manual_seed(5)
    return (torch.randn(16, 33, generator=g), torch.randn(9, 64, generator=g),
            torch.tensor([[1, 4, 4]]), torch.tensor([[9]]), torch.tensor([500.0]))


def first_forward(model, precisions=("weights", "auto")) -> None:
    """The first forward pass of a loaded DiT in bf16 (what dtype auto runs on a GPU),
    dequantising and on the low-precision products a capability 12.0 GPU takes (the CPU
    standing in, every kernel call checked): finite, or a weight of extreme magnitude that the
    pipeline's per-batch check stops at cleanly, instead of writing black frames."""
    from kernel_checks import capable_gpu
    from seedvr2.loading.packed_layers import set_compute_precision
    from seedvr2.memory.device_choice import NonFiniteError, check_finite

    inputs = [t.to(torch.bfloat16) if t.is_floating_point() and t.dim() == 2 else t
              for t in _inputs()]
    with torch.no_grad():
        for precision in precisions:
            set_compute_precision(model, precision)
            with capable_gpu((12, 0)):
                out = model(*inputs)
            if not bool(torch.isfinite(out).all()):
                with pytest.raises(NonFiniteError, match="batch 0"):
                    check_finite(out, "DiT", torch.bfloat16, "batch 0 (frames 0 to 0)")


def check_file(path: Path, kind: str = "dit", refuse: str | None = None, names=(),
               precision: str = "auto") -> bool:
    """Every door a weight file enters by. ``refuse``: why the file must be refused at load
    (None: read or refused, both fine); ``names``: what the refusal must name besides the
    file. Returns whether it loaded."""
    inspected = run_cli(["inspect", str(path)])
    assert inspected.status == 0 or str(path) in inspected.stderr, inspected.stderr
    load = load_dit if kind == "dit" else load_vae
    loaded = outcome(lambda: load(path, dtype=torch.bfloat16), str(path),
                     *(names if refuse else ()))
    # One assertion per reason, so that Hypothesis reports each kind as its own failure.
    if refuse is not None and refuse.startswith("non-finite"):
        assert loaded.refused, f"loaded a file holding non-finite values ({refuse})"
    elif refuse is not None and " stored as " in refuse:
        assert loaded.refused, f"loaded a file whose scale has the wrong dtype or shape ({refuse})"
    elif refuse is not None:
        assert loaded.refused, f"loaded a file it must refuse ({refuse})"
    if refuse is not None:
        return False
    if not loaded.refused and kind == "dit":
        first_forward(loaded.value, (precision,))
    return not loaded.refused


# ---------------------------------------------------------------------------------------------
# 1. comfy_quant markers


def json_values(max_leaves: int = 6):
    scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                        max_leaves=max_leaves)


FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "mxfp8", "nvfp4", "int4",
           "convrot_w4a4", "")
GROUPS = (-4, 0, 1, 2, 3, 4, 16, 48, 64, 128, 256, 1024, 2 ** 40)

markers = st.one_of(
    st.fixed_dictionaries(
        {"format": st.sampled_from(FORMATS) | json_values(2)},
        optional={"convrot": st.booleans() | json_values(2),
                  "convrot_groupsize": st.sampled_from(GROUPS) | json_values(2),
                  "params": st.fixed_dictionaries(
                      {}, optional={"convrot": st.booleans() | json_values(2),
                                    "convrot_groupsize": st.sampled_from(GROUPS)}) | json_values(2)}),
    json_values())
marker_bytes = st.one_of(
    markers.map(lambda m: json.dumps(m).encode()),
    st.binary(max_size=24),
    st.integers(1, 100_000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting
    st.integers(1, 100_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n))


def _quantised_layers(entries) -> list[str]:
    return sorted(k[: -len(".comfy_quant")] for k in entries if k.endswith(".comfy_quant"))


@few(12)
@given(data=st.data())
def test_comfy_quant_markers_are_read_or_refused_naming_the_layer(bases, tmp_path, data):
    target = data.draw(st.sampled_from(SAFETENSORS_TARGETS), "target")
    _, entries, metadata = bases[target]
    entries, metadata = dict(entries), dict(metadata)
    layer = data.draw(st.sampled_from(_quantised_layers(entries)[:6]), "layer")
    raw = data.draw(marker_bytes, "marker")
    where = data.draw(st.sampled_from(["tensor", "tensor as I32", "metadata", "metadata table"]),
                      "where")
    if where == "tensor":
        entries[f"{layer}.comfy_quant"] = ["U8", [len(raw)], raw]
    elif where == "tensor as I32":
        raw = raw + b" " * (-len(raw) % 4)
        entries[f"{layer}.comfy_quant"] = ["I32", [len(raw) // 4], raw]
    else:
        del entries[f"{layer}.comfy_quant"]
        text = raw.decode("utf-8", "replace")
        if where == "metadata table":  # a layers table of any shape
            table = data.draw(json_values() | st.just({layer: None}), "table")
            text = json.dumps({"format_version": "1.0", "layers": table})
        else:
            text = json.dumps({"format_version": "1.0", "layers": {layer: json.loads(text)}}) \
                if _is_json(text) else text
        metadata["_quantization_metadata"] = text
    check_file(write_raw(tmp_path / "marker.safetensors", entries, metadata),
               precision=data.draw(st.sampled_from(["auto", "weights"]), "compute_precision"))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return False


# ---------------------------------------------------------------------------------------------
# 2. scale tensors (and the weights they scale) of every dtype and shape

# What each target's parts may be, as ComfyUI's layouts define them (comfy/quant_ops.py and
# comfy-kitchen 0.2.40's layouts): name -> (dtypes, shapes as a function of the weight's
# logical (rows, cols)). Anything else must be refused at load, naming the tensor.
def _tiles(rows, blocks):
    return [-(-rows // 128) * 128, -(-blocks // 4) * 4]


ALLOWED = {
    "fp8_e4m3fn": {"weight": (("F8_E4M3",), lambda r, c: [[r, c]]),
                   "weight_scale": (FLOATS, lambda r, c: [[], [1], [r], [r, 1]])},
    "fp8_e5m2": {"weight": (("F8_E5M2",), lambda r, c: [[r, c]]),
                 "weight_scale": (FLOATS, lambda r, c: [[], [1], [r], [r, 1]])},
    "int8": {"weight": (("I8",), lambda r, c: [[r, c]]),
             "weight_scale": (FLOATS, lambda r, c: [[], [1], [r], [r, 1]])},
    "int8_convrot": {"weight": (("I8",), lambda r, c: [[r, c]]),
                     "weight_scale": (FLOATS, lambda r, c: [[], [1], [r], [r, 1]])},
    "mxfp8": {"weight": (("F8_E4M3",), lambda r, c: [[r, c]]),
              "weight_scale": (("U8", "F8_E8M0"), lambda r, c: [_tiles(r, c // 32)])},
    "nvfp4": {"weight": (("U8",), lambda r, c: [[r, c // 2]]),
              "weight_scale": (("F8_E4M3", "U8"), lambda r, c: [_tiles(r, c // 16)]),
              "weight_scale_2": (FLOATS, lambda r, c: [[], [1]])},
}


def _logical(target, entries, layer) -> tuple[int, int]:
    rows, cols = entries[f"{layer}.weight"][1]
    return (rows, 2 * cols) if target == "nvfp4" else (rows, cols)


def _non_finite(dtype: str, blob: bytes) -> bool:
    torch_dtype, _ = ST_DTYPES[dtype]
    t = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    if dtype == "F8_E8M0":
        return bool((t == 0xFF).any())
    if dtype in ("F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"):
        return not bool(torch.isfinite(t.view(torch_dtype).float()).all())
    return False


@few(12)
@given(data=st.data())
def test_scale_tensors_of_every_dtype_and_shape(bases, tmp_path, data):
    target = data.draw(st.sampled_from(list(ALLOWED)), "target")
    _, entries, metadata = bases[target]
    entries = dict(entries)
    layer = data.draw(st.sampled_from(_quantised_layers(entries)[:6]), "layer")
    part = data.draw(st.sampled_from(list(ALLOWED[target])), "part")
    rows, cols = _logical(target, entries, layer)
    dtypes, shapes = ALLOWED[target][part]
    right = shapes(rows, cols)
    dtype = data.draw(st.sampled_from(dtypes) | st.sampled_from(sorted(ST_DTYPES)), "dtype")
    shape = data.draw(st.sampled_from(right) | st.sampled_from(
        [[], [1], [rows], [rows, 1], [1, rows], [rows + 1], [rows, 2], [cols], [rows, cols],
         [right[0][0] + 1] + right[0][1:] if right[0] else [2]])
        | st.lists(st.integers(0, 5), max_size=3), "shape")
    size = math.prod(shape) * ST_DTYPES[dtype][1]
    if size <= 64:
        blob = data.draw(st.binary(min_size=size, max_size=size), "values")
    else:  # random bytes from a seed, or the same values written in another dtype
        seed = data.draw(st.integers(0, 2 ** 16), "seed")
        blob = torch.randint(0, 256, (size,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    entries[f"{layer}.{part}"] = [dtype, shape, blob]
    wrong = dtype not in dtypes or shape not in right
    refuse = f"{part} stored as {dtype} {shape}" if wrong else \
        "non-finite values" if _non_finite(dtype, blob) else None
    check_file(write_raw(tmp_path / "scale.safetensors", entries, metadata), refuse=refuse,
               names=(f"{layer}.{part}",),
               precision=data.draw(st.sampled_from(["auto", "weights"]), "compute_precision"))


def test_a_scale_stored_in_another_float_dtype_reads_the_same(bases, tmp_path):
    """The accepted alternatives really are read as the values they hold."""
    _, entries, metadata = bases["int8"]
    layer = _quantised_layers(entries)[0]
    entries = dict(entries)
    scale = tensor_of(entries[f"{layer}.weight_scale"])
    original = load_dit(bases["int8"][0], dtype=torch.float32)
    for dtype, shape in (("F16", [scale.shape[0]]), ("BF16", [scale.shape[0], 1])):
        entries[f"{layer}.weight_scale"] = [dtype, shape, blob_of(
            scale.to(ST_DTYPES[dtype][0]).to(torch.float32).to(ST_DTYPES[dtype][0]))]
        model = load_dit(write_raw(tmp_path / "alt.safetensors", entries, metadata),
                         dtype=torch.float32)
        name = layer
        ours = model.get_submodule(name).weight
        expected = original.get_submodule(name).weight
        rounded = (scale.to(ST_DTYPES[dtype][0]).float() / scale).reshape(-1, 1)
        assert torch.equal(ours, expected * rounded) or \
            torch.allclose(ours, expected * rounded, rtol=2 ** -20, atol=0)


# ---------------------------------------------------------------------------------------------
# 3. non-finite values in any tensor: refused at load (and by quantize), naming the tensor

NON_FINITE = {  # dtype -> byte patterns of NaN, +inf, -inf (where the dtype has them)
    "F32": [struct.pack("<f", float(v)) for v in ("nan", "inf", "-inf")],
    "F16": [struct.pack("<e", float(v)) for v in ("nan", "inf", "-inf")],
    "BF16": [b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"],
    "F8_E4M3": [b"\x7f", b"\xff"],
    "F8_E5M2": [b"\x7c", b"\xfc", b"\x7e"],
    "F8_E8M0": [b"\xff"],
}


@few(10)
@given(data=st.data())
def test_non_finite_values_are_refused_at_load_and_by_quantize(bases, tmp_path, data):
    name = data.draw(st.sampled_from(FLOAT_FILES + SAFETENSORS_TARGETS + ("vae",)), "file")
    _, entries, metadata = bases[name]
    entries = dict(entries)
    if name == "mxfp8":  # the E8M0 scales, as the file stores them (U8 or F8_E8M0)
        entries = {k: (["F8_E8M0", *e[1:]] if k.endswith("weight_scale") else e)
                   for k, e in entries.items()}
    candidates = sorted(k for k, (dtype, shape, _) in entries.items()
                        if dtype in NON_FINITE and math.prod(shape) > 0)
    key = data.draw(st.sampled_from(candidates), "tensor")
    dtype, shape, blob = entries[key]
    size = ST_DTYPES[dtype][1]
    index = data.draw(st.integers(0, math.prod(shape) - 1), "index")
    value = data.draw(st.sampled_from(NON_FINITE[dtype]), "value")
    entries[key] = [dtype, shape, blob[:index * size] + value + blob[(index + 1) * size:]]
    path = write_raw(tmp_path / "nonfinite.safetensors", entries, metadata)
    check_file(path, "vae" if name == "vae" else "dit", refuse="non-finite value", names=(key,))


@few(8)
@given(data=st.data())
def test_quantize_refuses_non_finite_values(bases, tmp_path, data):
    """``seedvr2 quantize`` of a file holding NaN or inf writes nothing, naming the tensor."""
    name = data.draw(st.sampled_from(FLOAT_FILES + ("int8", "nvfp4")), "file")
    _, entries, metadata = bases[name]
    entries = dict(entries)
    candidates = sorted(k for k, (dtype, shape, _) in entries.items()
                        if dtype in NON_FINITE and math.prod(shape) > 0)
    key = data.draw(st.sampled_from(candidates), "tensor")
    dtype, shape, blob = entries[key]
    size = ST_DTYPES[dtype][1]
    index = data.draw(st.integers(0, math.prod(shape) - 1), "index")
    value = data.draw(st.sampled_from(NON_FINITE[dtype]), "value")
    entries[key] = [dtype, shape, blob[:index * size] + value + blob[(index + 1) * size:]]
    path = write_raw(tmp_path / "nonfinite.safetensors", entries, metadata)
    target = data.draw(st.sampled_from(SAFETENSORS_TARGETS + ("Q8_0",)), "quantize to")
    out = tmp_path / ("out.gguf" if target == "Q8_0" else "out.safetensors")
    if target == "Q8_0":
        pytest.importorskip("gguf")
    out.unlink(missing_ok=True)
    run = run_cli(["quantize", str(path), str(out), "--type", target, "-q"])
    assert run.status != 0, f"quantize wrote {out.name} from a file holding {value!r} in {key}"
    assert str(path) in run.stderr and key in run.stderr, run.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# 4. safetensors headers and metadata edited at random (consistent offsets: past the header
# checks, into detection, layouts and loading)

KEY_PARTS = ("blocks", "0", "1", "3", "attn", "proj_qkv", "vid", "txt", "all", "weight",
             "weight_scale", "comfy_quant", "vid_in", "proj", "vid_out", "encoder", "conv_in",
             "decoder", "conv_out", "rope", "freqs", "model", "diffusion_model", "mlp",
             "proj_in_gate", "norm_q", "emb_in", "txt_in", "positive_conditioning")
keys = st.lists(st.sampled_from(KEY_PARTS), min_size=1, max_size=6).map(".".join)
shapes_ = st.lists(st.integers(0, 600), max_size=4) | st.lists(st.integers(0, 3), max_size=6)


@st.composite
def header_edits(draw, entries: dict, metadata: dict):
    entries, metadata = dict(entries), dict(metadata)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["drop", "rename", "reshape", "retype", "add", "metadata"]))
        key = draw(st.sampled_from(sorted(entries))) if entries else None
        if action == "drop" and key:
            del entries[key]
        elif action == "rename" and key:
            entries[draw(keys)] = entries.pop(key)
        elif action in ("reshape", "retype", "add"):
            dtype = draw(st.sampled_from(sorted(ST_DTYPES))) if action != "reshape" or not key \
                else entries[key][0]
            shape = draw(shapes_) if action != "retype" or not key else entries[key][1]
            if math.prod(shape) * ST_DTYPES[dtype][1] > 1 << 20:
                continue
            blob = bytes(math.prod(shape) * ST_DTYPES[dtype][1])
            entries[key if action != "add" and key else draw(keys)] = [dtype, shape, blob]
        else:
            name = draw(st.sampled_from(["config", "_quantization_metadata", "format", "x"]))
            value = draw(json_values() | st.text(max_size=20))
            metadata[name] = value if isinstance(value, str) else json.dumps(value)
    return entries, metadata


@few(10)
@given(data=st.data())
def test_safetensors_headers_and_metadata(bases, tmp_path, data):
    name = data.draw(st.sampled_from(("fp16", "int8_convrot", "nvfp4", "mxfp8", "vae")), "file")
    _, entries, metadata = bases[name]
    entries, metadata = data.draw(header_edits(entries, metadata), "edits")
    path = write_raw(tmp_path / "edited.safetensors", entries, metadata)
    check_file(path, "vae" if name == "vae" else "dit",
               precision=data.draw(st.sampled_from(["auto", "weights"]), "compute_precision"))
    if data.draw(st.booleans(), "quantize it"):
        run = run_cli(["quantize", str(path), str(tmp_path / "q.gguf"), "--type", "Q8_0",
                       "--overwrite", "-q"])
        assert run.status == 0 or str(path) in run.stderr, run.stderr


# ---------------------------------------------------------------------------------------------
# 5. GGUF headers: any field of a valid file changed, or any bytes of its header


def gguf_fields(data: bytes) -> list[tuple[str, int, str]]:
    """(what, offset, struct format) of every fixed-size field of a little-endian GGUF v3
    header: the counts, each metadata value's type and scalars, each tensor's dimensions,
    type and offset."""
    fields = [("tensor count", 8, "<Q"), ("kv count", 16, "<Q")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(pos):
        (n,) = struct.unpack_from("<Q", data, pos)
        return pos + 8 + n

    sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
             12: "d"}
    for _ in range(n_kv):
        fields.append(("key length", pos, "<Q"))
        pos = string(pos)
        (kind,) = struct.unpack_from("<I", data, pos)
        fields.append(("value type", pos, "<I"))
        pos += 4
        if kind == 8:
            fields.append(("string length", pos, "<Q"))
            pos = string(pos)
        elif kind == 9:
            (item,) = struct.unpack_from("<I", data, pos)
            fields += [("array type", pos, "<I"), ("array length", pos + 4, "<Q")]
            (count,) = struct.unpack_from("<Q", data, pos + 4)
            pos += 12
            for i in range(count):
                if item == 8:
                    pos = string(pos)
                else:
                    fields.append(("array item", pos, "<" + sizes[item]))
                    pos += struct.calcsize(sizes[item])
        else:
            fields.append(("value", pos, "<" + sizes[kind]))
            pos += struct.calcsize(sizes[kind])
    for _ in range(n_tensors):
        pos = string(pos)
        (dims,) = struct.unpack_from("<I", data, pos)
        fields.append(("dimension count", pos, "<I"))
        pos += 4
        for d in range(dims):
            fields.append(("dimension", pos, "<Q"))
            pos += 8
        fields += [("tensor type", pos, "<I"), ("tensor offset", pos + 4, "<Q")]
        pos += 12
    fields.append(("(end of header)", pos, ""))
    return fields


@few(10)
@given(data=st.data())
def test_gguf_headers(gguf_base, tmp_path, data):
    fields = gguf_fields(gguf_base)
    end = fields[-1][1]
    raw = bytearray(gguf_base)
    for _ in range(data.draw(st.integers(1, 3), "edits")):
        if data.draw(st.booleans(), "field or bytes"):
            what, offset, fmt = data.draw(st.sampled_from(fields[:-1]), "field")
            bits = struct.calcsize(fmt) * 8
            if fmt[-1] in "fd":
                value = data.draw(st.floats(width=bits if bits < 64 else 64), "float")
            elif fmt[-1] == "?":
                value = data.draw(st.booleans(), "bool")
            else:
                signed = fmt[-1].islower()
                low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else \
                    (0, (1 << bits) - 1)
                value = data.draw(st.integers(low, high) | st.sampled_from(
                    [low, high, 0, 1, 2, 3, 5, 7, 8, 9, 12, 30, 31, 255]).filter(
                        lambda v: low <= v <= high), "int")
            struct.pack_into(fmt, raw, offset, value)
        else:
            offset = data.draw(st.integers(0, end - 1), "offset")
            chunk = data.draw(st.binary(min_size=1, max_size=8), "bytes")
            raw[offset:offset + len(chunk)] = chunk
    assume(bytes(raw) != gguf_base)
    path = tmp_path / "edited.gguf"
    path.write_bytes(bytes(raw))
    check_file(path)


@few(8)
@given(data=st.data())
def test_gguf_scales_and_metadata(bases, tmp_path, data):
    """GGUF files written with hostile metadata values and non-finite block scales."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    state = load_file(bases["fp32"][0])
    config = read_raw(bases["fp32"][0])[1]["config"]
    path = tmp_path / "written.gguf"
    writer = gguf.GGUFWriter(path, arch="seedvr2")
    bad_key = None
    choice = data.draw(st.sampled_from(["config", "orig_shape", "nan scale", "nan plain"]), "case")
    if choice == "config":
        value = data.draw(json_values() | st.text(max_size=30), "config")
        writer.add_string("seedvr2.config", value if isinstance(value, str) else json.dumps(value))
    else:
        writer.add_string("seedvr2.config", config)
    keys = sorted(state)
    target = data.draw(st.sampled_from([k for k in keys if state[k].dim() == 2
                                        and state[k].shape[1] % 32 == 0]), "tensor")
    for key in keys:
        tensor = state[key].float().numpy()
        if key == target and choice == "orig_shape":
            shape = data.draw(st.lists(st.integers(-3, 600), max_size=5), "orig_shape")
            writer.add_array(f"comfy.gguf.orig_shape.{key}", shape)
        if key == target and choice == "nan scale":
            blocks = gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0)
            flat = blocks.reshape(-1, 34).copy()
            row = data.draw(st.integers(0, len(flat) - 1), "block")
            flat[row, 0:2] = np.frombuffer(data.draw(st.sampled_from(NON_FINITE["F16"])),
                                           dtype=np.uint8)
            writer.add_tensor(key, flat.reshape(blocks.shape),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            bad_key = key
            continue
        if key == target and choice == "nan plain":
            tensor = tensor.copy()
            tensor.reshape(-1)[data.draw(st.integers(0, tensor.size - 1), "index")] = \
                float(data.draw(st.sampled_from(["nan", "inf", "-inf"])))
            bad_key = key
        writer.add_tensor(key, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_file(path, refuse="non-finite value" if bad_key else None,
               names=(bad_key,) if bad_key else ())
