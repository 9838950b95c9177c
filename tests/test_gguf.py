"""GGUF: torch dequantisation bit-for-bit equal to gguf.quants, files written by `quantize`
(read back by the gguf package and by our loader), conventions and bad files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

gguf = pytest.importorskip("gguf")

from seedvr2.loading import CheckpointError, describe, load_dit, load_vae  # noqa: E402
from seedvr2.loading import gguf as gguf_loader  # noqa: E402
from seedvr2.loading.gguf import BLOCK_SIZES, dequantize_blocks  # noqa: E402
from seedvr2.loading.quantize import quantize_file  # noqa: E402
from seedvr2.loading.packed_layers import PackedWeightMixin, packed_modules  # noqa: E402

from conftest import (constructor_kwargs, dit_bound, dit_output, integer_step_error,  # noqa: E402
                      load_case, quantization_bound, relative_error)

# Byte offsets of the fp16 scale fields of each block type: set to finite values so that
# random blocks decode to numbers (random bytes there could be inf/NaN).
FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
               "IQ4_NL": [0], "IQ4_XS": [0]}


def random_blocks(qtype: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    _, type_size = BLOCK_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = (rng.standard_normal((n_blocks, 1)) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8)
    return blocks


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
def test_dequantize_is_bit_exact_on_random_blocks(qtype):
    blocks = random_blocks(qtype, 96)
    expected = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype))
    ours = dequantize_blocks(torch.from_numpy(blocks), qtype)
    assert np.array_equal(bits(ours.numpy()), bits(expected.reshape(-1)))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_dequantize_is_bit_exact_on_quantised_weights(qtype):
    weights = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32) * 0.02
    packed = gguf.quants.quantize(weights, getattr(gguf.GGMLQuantizationType, qtype))
    expected = gguf.quants.dequantize(packed, getattr(gguf.GGMLQuantizationType, qtype))
    ours = dequantize_blocks(torch.from_numpy(packed), qtype).reshape(64, 256)
    assert np.array_equal(bits(ours.numpy()), bits(expected))
    # It is a quantisation of `weights`: off by at most one step of the coarsest type here,
    # Q4_0 (16 levels, step absmax/8, a full step where the far side is clamped to 7).
    assert float(np.abs(expected - weights).max()) <= float(np.abs(weights).max()) / 8


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
def test_dequantize_across_chunk_boundaries(qtype, threads, monkeypatch):
    # On the CPU, blocks are decoded in chunks, and with several torch threads by as many
    # Python threads, each taking runs of chunks that share one scales computation. Small
    # chunks here, so that 197 blocks make several of each, the last ones partial.
    block_size, _ = BLOCK_SIZES[qtype]
    monkeypatch.setattr(gguf_loader, "CPU_CHUNK_VALUES", 1024)
    monkeypatch.setattr(gguf_loader, "THREAD_CHUNK_VALUES", 2048)
    n_blocks = 197
    blocks = random_blocks(qtype, n_blocks, seed=2)
    original = blocks.copy()
    expected = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step, run, workers = gguf_loader._schedule(n_blocks, block_size, torch.device("cpu"))
        assert workers == threads and step < n_blocks and (threads == 1 or step < run < n_blocks)
        ours = dequantize_blocks(torch.from_numpy(blocks), qtype)
        with torch.inference_mode():  # worker threads take the caller's mode
            rounded = dequantize_blocks(torch.from_numpy(blocks), qtype, torch.bfloat16)
    finally:
        torch.set_num_threads(previous)
    assert np.array_equal(bits(ours.numpy()), bits(expected.reshape(-1)))
    assert torch.equal(rounded, torch.from_numpy(expected.reshape(-1)).bfloat16())
    assert np.array_equal(blocks, original)  # the packed bytes are only read


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_dequantize_default_chunks_and_unaligned_input(qtype):
    # More blocks than one default chunk, given at an odd byte offset (copied, then decoded).
    _, type_size = BLOCK_SIZES[qtype]
    n_blocks = gguf_loader.CPU_CHUNK_VALUES // 256 * 2 + 5
    blocks = random_blocks(qtype, n_blocks, seed=3)
    expected = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype))
    shifted = torch.zeros(blocks.size + 1, dtype=torch.uint8)
    shifted[1:] = torch.from_numpy(blocks.reshape(-1))
    ours = dequantize_blocks(shifted[1:].view(n_blocks, type_size), qtype)
    assert np.array_equal(bits(ours.numpy()), bits(expected.reshape(-1)))


def test_dequantize_in_compute_dtype():
    blocks = torch.from_numpy(random_blocks("Q4_K", 8))
    assert dequantize_blocks(blocks, "Q4_K", torch.bfloat16).dtype == torch.bfloat16
    torch.testing.assert_close(dequantize_blocks(blocks, "Q4_K", torch.float16),
                               dequantize_blocks(blocks, "Q4_K").half(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# files


@pytest.fixture(scope="module")
def dit3b_file(tiny_model_dir):
    return tiny_model_dir / "dit3b_tiny.safetensors"  # read only: the folder is shared


@pytest.fixture(scope="module")
def dit3b_q8(dit3b_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "dit3b_Q8_0.gguf"
    quantize_file(dit3b_file, out, "Q8_0")
    return out


def test_quantized_gguf_opens_with_the_gguf_reader(dit3b_q8):
    reader = gguf.GGUFReader(dit3b_q8)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blocks.0.attn.proj_qkv.vid.weight"] == "Q8_0"
    # norms, biases, modulation vectors and the input/output projections stay unquantised
    assert types["blocks.0.attn.norm_q.vid.weight"] == "F32"
    assert types["vid_in.proj.weight"] == types["vid_out.proj.weight"] == "F32"
    assert types["txt_in.weight"] == types["emb_in.proj_in.weight"] == "F32"
    config = json.loads(reader.fields["seedvr2.config"].contents())
    assert config["vid_dim"] == 128 and config["mm_layers"] == 2


# Per-weight relative error of each type: 32-weight blocks with a shared scale, 127 levels for
# Q8_0 and 8 for Q4_0 (conftest.integer_step_error).
LEVELS = {"Q8_0": 127, "Q4_0": 8}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_dit_from_gguf_error_is_bounded(conformance, dit3b_file, dit3b_q8, qtype, tmp_path):
    path = dit3b_q8
    if qtype != "Q8_0":
        path = tmp_path / f"dit3b_{qtype}.gguf"
        quantize_file(dit3b_file, path, qtype)
    case = load_case(conformance / "dit3b_tiny", "image")
    reference = dit_output(load_dit(dit3b_file), case)
    model = load_dit(path, dtype=torch.float32)
    packed = packed_modules(model)
    assert len(packed) == 30 and {p.label for p in packed.values()} == {qtype}
    error = relative_error(dit_output(model, case), reference)
    print(f"DiT 3B tiny, {qtype} weights: relative output error {error:.2e}")
    # Bounds 0.036 (Q8_0) and 0.57 (Q4_0); measured 3.5e-3 and 5.5e-2. The floor: quantised
    # weights really are in use (float32 rounding alone stays below 1e-5 here).
    bound = quantization_bound([integer_step_error(LEVELS[qtype], 32)] * len(packed))
    assert 1e-5 < error < bound


def test_packed_and_expanded_weights_give_the_same_output(conformance, dit3b_q8):
    case = load_case(conformance / "dit3b_tiny", "image")
    packed = load_dit(dit3b_q8, dtype=torch.float32)
    expanded = load_dit(dit3b_q8, dtype=torch.float32, keep_packed=False)
    assert not packed_modules(expanded)
    assert torch.equal(dit_output(packed, case), dit_output(expanded, case))


def test_packed_weights_keep_storage_through_dtype_and_device_moves(dit3b_q8):
    model = load_dit(dit3b_q8, dtype=torch.float32)
    layer = model.blocks[0].attn.proj_qkv["vid"]
    assert isinstance(layer, PackedWeightMixin) and isinstance(layer, torch.nn.Linear)
    blocks = layer.weight_blocks
    model.to(torch.bfloat16)
    assert layer.weight_blocks.dtype == torch.uint8 and torch.equal(layer.weight_blocks, blocks)
    assert layer.compute_dtype == torch.bfloat16 and layer.weight.dtype == torch.bfloat16
    assert model.blocks[0].attn.norm_q["vid"].weight.dtype == torch.bfloat16
    model.float()
    assert layer.weight.dtype == torch.float32 and "packed=Q8_0" in repr(layer)
    # The packed blocks are a view of the file's memory map, not a copy.
    assert describe(dit3b_q8)["dtypes"] == ["Q8_0", "float32"]


def test_vae_gguf_with_original_shapes(conformance, tmp_path):
    folder = conformance / "vae_tiny"
    src = tmp_path / "vae.safetensors"
    save_file(load_file(folder / "weights.safetensors"), src,
              metadata={"config": json.dumps(constructor_kwargs(folder))})
    out = tmp_path / "vae_Q8_0.gguf"
    quantize_file(src, out, "Q8_0")
    reader = gguf.GGUFReader(out)
    orig = reader.fields["comfy.gguf.orig_shape.encoder.down_blocks.1.resnets.0.conv1.weight"]
    assert orig.contents() == [24, 16, 3, 3, 3]
    assert max(len(t.shape) for t in reader.tensors) <= 4
    case = load_file(folder / "cases" / "image_1f.safetensors")
    vae = load_vae(out, dtype=torch.float32)
    assert "encoder.down_blocks.1.resnets.0.conv1" in packed_modules(vae)
    with torch.no_grad():
        mean = vae.encode(case["inputs.video"])
    error = relative_error(mean, case["outputs.posterior_mean"])
    print(f"VAE tiny, Q8_0 weights: relative posterior-mean error {error:.2e}")
    # Every quantised encoder convolution adds its weights' error; measured 1.4e-2.
    quantised = [name for name in packed_modules(vae) if name.startswith("encoder.")]
    assert error < quantization_bound([integer_step_error(127, 32)] * len(quantised))


# ---------------------------------------------------------------------------------------------
# hand-written GGUF files: conventions and bad files


def write_gguf(path, tensors: dict, qtypes: dict | None = None, fields: dict | None = None):
    """A GGUF with float32 numpy tensors (or raw uint8 blocks with a given GGML type)."""
    writer = gguf.GGUFWriter(path, arch="seedvr2")
    for key, value in (fields or {}).items():
        writer.add_array(key, value) if isinstance(value, list) else writer.add_string(key, value)
    for name, array in tensors.items():
        qtype = (qtypes or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def dit3b_state(dit3b_file):
    return {k: v.numpy() for k, v in load_file(dit3b_file).items()}


def test_comfy_prefix_is_stripped(conformance, dit3b_state, tmp_path):
    path = tmp_path / "prefixed.gguf"
    config = json.dumps(constructor_kwargs(conformance / "dit3b_tiny"))
    write_gguf(path, {f"model.diffusion_model.{k}": v for k, v in dit3b_state.items()},
               fields={"seedvr2.config": config})
    case = load_case(conformance / "dit3b_tiny", "image")
    model, expected = load_dit(path), case["outputs.vid_sample"]
    torch.testing.assert_close(dit_output(model, case), expected,
                               atol=dit_bound(model, case, expected), rtol=0)


def test_gguf_missing_tensor(dit3b_state, tmp_path):
    path = tmp_path / "missing.gguf"
    write_gguf(path, {k: v for k, v in dit3b_state.items() if k != "blocks.1.mlp.txt.proj_in.weight"})
    with pytest.raises(CheckpointError, match=r"missing\.gguf: missing 1 tensor\(s\), e\.g\. "
                                              r"\['blocks\.1\.mlp\.txt\.proj_in\.weight'\]"):
        load_dit(path)


def test_truncated_gguf(dit3b_q8, tmp_path):
    data = dit3b_q8.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: (truncated GGUF file|unreadable GGUF)"):
        load_dit(path)
    path.write_bytes(data[:100])  # inside the header
    with pytest.raises(CheckpointError, match=r"cut\.gguf: unreadable GGUF file, truncated or corrupt"):
        load_dit(path)


def test_gguf_with_damaged_counts_is_one_error_and_left_out_of_lists(tmp_path):
    """All-ones counts: the header walk for the error message points past any offset
    (OverflowError, not caught before), so `describe` and the loaders' lists raised."""
    from seedvr2.loading import describe
    from seedvr2.workflow.nodes import _file_kind

    path = tmp_path / "damaged.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(CheckpointError, match=r"damaged\.gguf: unreadable GGUF file, truncated "
                                              r"or corrupt"):
        describe(path)
    assert _file_kind(path) is None


def test_unsupported_quant_type_names_tensor_and_type(dit3b_state, tmp_path):
    path = tmp_path / "q8_1.gguf"
    tensors = dict(dit3b_state)
    # Q8_1 blocks: 32 values in 40 bytes; readable by gguf, not dequantised by us.
    tensors["blocks.0.attn.proj_out.vid.weight"] = np.zeros((128, 128 // 32 * 40), np.uint8)
    write_gguf(path, tensors, qtypes={"blocks.0.attn.proj_out.vid.weight": "Q8_1"})
    with pytest.raises(CheckpointError, match=r"q8_1\.gguf: tensor 'blocks\.0\.attn\.proj_out\.vid"
                                              r"\.weight' has GGML type Q8_1, which this loader "
                                              r"cannot dequantise"):
        load_dit(path)


def test_unknown_type_id_names_file_tensor_and_type(tmp_path):
    # A type id newer than the installed gguf package: the reader itself fails on it.
    path = tmp_path / "future.gguf"
    write_gguf(path, {"blocks.0.a.weight": np.zeros((4, 32), np.float32),
                      "blocks.0.b.weight": np.zeros((4, 32), np.float32)})
    reader = gguf.GGUFReader(path)
    field = next(t.field for t in reader.tensors if t.name == "blocks.0.b.weight")
    # tensor info: name length, name, n_dims, dims, then the uint32 type id
    type_offset = field.offset + sum(int(part.nbytes) for part in field.parts[:4])
    assert int(field.parts[4][0]) == gguf.GGMLQuantizationType.F32
    del reader, field
    data = bytearray(path.read_bytes())
    data[type_offset:type_offset + 4] = struct.pack("<I", 250)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        describe(path)
    assert str(error.value) == (
        f"{path}: tensor 'blocks.0.b.weight' has GGML type id 250, which the installed gguf "
        f"package does not know; update gguf, or re-quantise the file to one of F32, F16, BF16, "
        f"Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS")


def test_gguf_of_another_architecture(tmp_path):
    path = tmp_path / "sdxl.gguf"
    write_gguf(path, {"input_blocks.0.0.weight": np.zeros((4, 4, 3, 3), np.float32),
                      "time_embed.0.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(CheckpointError, match=r"sdxl\.gguf: expected a SeedVR2 DIT checkpoint, "
                                              r"but not a SeedVR2 model"):
        load_dit(path)


def test_gguf_wrong_original_shape(dit3b_state, tmp_path):
    path = tmp_path / "shape.gguf"
    write_gguf(path, dit3b_state, fields={"comfy.gguf.orig_shape.txt_in.weight": [3, 5]})
    with pytest.raises(CheckpointError, match=r"shape\.gguf: tensor 'txt_in\.weight' has 8192 "
                                              r"values but its shape \[3, 5\] needs 15"):
        load_dit(path)
