"""fp8 / int8 / ComfyUI-repackaged layouts kept packed and dequantised per layer; embedded text
embeddings; the registry's downloads and model-name checks."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from seedvr2.loading import CheckpointError, describe, load_dit
from seedvr2.loading import registry
from seedvr2.loading.quantize import quantize_file
from seedvr2.loading.int8 import regular_hadamard
from seedvr2.loading.nvfp4 import E2M1_VALUES
from seedvr2.loading.packed import swizzle_block_scales, unswizzle_block_scales
from seedvr2.loading.packed_layers import packed_modules
from seedvr2.loading.text import load_text_embeddings

from conftest import (constructor_kwargs, dit_output, float_step_error, integer_step_error,
                      load_case, quantization_bound, relative_error, rounding_bound)


@pytest.fixture(scope="module")
def tiny(conformance):
    folder = conformance / "dit3b_tiny"
    state = load_file(folder / "weights.safetensors")
    config = json.dumps(constructor_kwargs(folder))
    case = load_case(folder, "image")
    return state, config, case


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    state, config, case = tiny
    path = tmp_path_factory.mktemp("ref") / "fp32.safetensors"
    save_file(state, path, metadata={"config": config})
    return path, dit_output(load_dit(path), case)


def is_big_weight(key: str, tensor: torch.Tensor) -> bool:
    return key.endswith(".weight") and tensor.dim() == 2 and key.startswith("blocks.")


# ---------------------------------------------------------------------------------------------
# fp8 files as released (plain casts, some blocks kept in fp16) and our quantize outputs


def test_plain_fp8_file_with_fp16_block(tiny, reference, tmp_path):
    state, config, case = tiny
    path = tmp_path / "fp8_mixed_block3_fp16.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) if is_big_weight(k, v) and not k.startswith("blocks.3.")
               else v.half() for k, v in state.items()}, path, metadata={"config": config})
    model = load_dit(path, dtype=torch.float32)
    packed = packed_modules(model)
    assert len(packed) == 25 and {p.label for p in packed.values()} == {"float8_e4m3fn"}
    assert not any(name.startswith("blocks.3.") for name in packed)
    assert describe(path)["dtypes"] == ["float16", "float8_e4m3fn"]
    error = relative_error(dit_output(model, case), reference[1])
    print(f"DiT 3B tiny, plain fp8 e4m3fn weights (block 3 fp16): relative error {error:.2e}")
    # A plain cast rounds to 3 mantissa bits (and to fp16's 10 in block 3, negligible): 0.18;
    # measured 1.6e-2.
    assert error < quantization_bound([float_step_error(3)] * len(packed))
    model.to(torch.bfloat16)  # storage stays fp8, the compute dtype follows
    layer = model.blocks[0].mlp["vid"].proj_in
    assert layer.weight_data.dtype == torch.float8_e4m3fn and layer.weight.dtype == torch.bfloat16


# Per-weight relative error of each target: fp8 rounds to 3 mantissa bits (per-tensor scale
# into the normal range), as does mxfp8 (per 32); int8 has 127 levels per output row of at most
# 512 inputs (rotated first for int8_convrot); nvfp4 rounds to e2m1's 1 mantissa bit (per 16).
WEIGHT_ERROR = {"fp8_e4m3fn": float_step_error(3), "int8": integer_step_error(127, 512),
                "int8_convrot": integer_step_error(127, 512), "mxfp8": float_step_error(3),
                "nvfp4": float_step_error(1)}
# What each target writes for blocks.0.attn.proj_qkv.vid (384 x 128): the comfy_quant marker
# and the scale tensors' safetensors dtype and shape (block scales in 128x4 tiles).
LAYOUT = {
    "fp8_e4m3fn": ({"format": "float8_e4m3fn"}, {"weight": ("F8_E4M3", [384, 128]),
                                                 "weight_scale": ("F32", [])}),
    "int8": ({"format": "int8_tensorwise"}, {"weight": ("I8", [384, 128]),
                                             "weight_scale": ("F32", [384, 1])}),
    "int8_convrot": ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 64},
                     {"weight": ("I8", [384, 128]), "weight_scale": ("F32", [384, 1])}),
    "mxfp8": ({"format": "mxfp8"}, {"weight": ("F8_E4M3", [384, 128]),
                                    "weight_scale": ("U8", [384, 4])}),
    "nvfp4": ({"format": "nvfp4"}, {"weight": ("U8", [384, 64]),
                                    "weight_scale": ("F8_E4M3", [384, 8]),
                                    "weight_scale_2": ("F32", [])}),
}


@pytest.mark.parametrize("target", list(WEIGHT_ERROR))
def test_quantize_targets_read_back(tiny, reference, target, tmp_path):
    _, _, case = tiny
    out = tmp_path / f"{target}.safetensors"
    summary = quantize_file(reference[0], out, target, keep=["blocks.3"])
    assert (summary.quantized, summary.kept) == (25, 78)
    header = json.loads(out.read_bytes()[8:8 + int.from_bytes(out.read_bytes()[:8], "little")])
    layer = "blocks.0.attn.proj_qkv.vid"
    marker, tensors = LAYOUT[target]
    assert json.loads(bytes(load_file(out)[f"{layer}.comfy_quant"].tolist())) == marker
    assert {name: (header[f"{layer}.{name}"]["dtype"], header[f"{layer}.{name}"]["shape"])
            for name in tensors} == tensors
    model = load_dit(out, dtype=torch.float32)
    assert len(packed_modules(model)) == 25
    error = relative_error(dit_output(model, case), reference[1])
    print(f"DiT 3B tiny, {target} weights: relative error {error:.2e}")
    # Bounds 0.18 (fp8, mxfp8), 0.042 (int8, int8_convrot) and 0.72 (nvfp4); measured 1.5e-2,
    # 1.6e-2, 3.8e-3, 4.0e-3 and 5.5e-2. The floor: quantised weights really are in use (float32 rounding alone stays
    # below 1e-5 here).
    assert 1e-5 < error < quantization_bound([WEIGHT_ERROR[target]] * 25)


@pytest.mark.parametrize("target", ["fp8_e4m3fn", "int8", "int8_convrot", "mxfp8", "nvfp4"])
def test_the_vae_is_not_written_in_comfyuis_layouts(conformance, tmp_path, target, capsys):
    """ComfyUI builds the SeedVR2 VAE with manual_cast, which reads no comfy_quant marker: a VAE
    in its quantised layouts would not load right there, so quantize refuses it and says why
    (GGUF, which this loader reads, stays available)."""
    from seedvr2.cli import main

    folder = conformance / "vae_tiny"
    src = tmp_path / "vae.safetensors"
    save_file(load_file(folder / "weights.safetensors"), src,
              metadata={"config": json.dumps(constructor_kwargs(folder))})
    out = tmp_path / "vae_q.safetensors"
    assert main(["quantize", str(src), str(out), "--type", target, "-q"]) == 1
    assert capsys.readouterr().err == (
        f"error: {src}: --type {target}: the VAE is not written in ComfyUI's quantised layouts: "
        f"ComfyUI builds the SeedVR2 VAE with manual_cast, which reads no comfy_quant marker, "
        f"so such a file would not load right there. Quantise the DiT, keep the VAE in fp16, "
        f"or use a GGUF type (Q8_0 ...) for this loader\n")
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "A VAE is refused for them" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("target", ["mxfp8", "nvfp4"])
def test_block_formats_are_bit_exact_with_comfy_kitchen(target):
    """Our quantisers write what comfy-kitchen's own (the reference of ComfyUI's files) does."""
    ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (the kitchen extra) not installed")
    from seedvr2.loading.mxfp8 import quantize_mxfp8
    from seedvr2.loading.nvfp4 import quantize_nvfp4

    weight = torch.randn(200, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    # Every e2m1 midpoint (ties round to the even code) in units of one block's step.
    weight[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6]).repeat(2) * \
        torch.tensor([1.0] * 8 + [-1.0] * 8)
    if target == "mxfp8":
        ours, theirs = quantize_mxfp8(weight), ck.quantize_mxfp8(weight)
    else:
        packed, block, scale_2 = quantize_nvfp4(weight)
        ours, theirs = (packed, block), ck.quantize_nvfp4(weight, scale_2)
    for mine, kitchen in zip(ours, theirs, strict=True):
        assert torch.equal(mine.view(torch.uint8), kitchen.view(torch.uint8).reshape(mine.shape))


# ---------------------------------------------------------------------------------------------
# ComfyUI repackaged layouts, encoded here from the documented formats


def encode_convrot(w: torch.Tensor, group: int):
    rows, cols = w.shape
    rotated = (w.view(rows, cols // group, group) @ regular_hadamard(group)).view(rows, cols)
    scale = rotated.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(rotated / scale).clamp(-127, 127).to(torch.int8), scale


def encode_mxfp8(w: torch.Tensor):
    rows, cols = w.shape
    amax = w.view(rows, cols // 32, 32).abs().amax(-1)
    exponent = torch.ceil(torch.log2(amax / 448)).to(torch.int32) + 127
    values = (w.view(rows, cols // 32, 32) / torch.exp2(exponent - 127.0).unsqueeze(-1))
    data = values.clamp(-448, 448).reshape(rows, cols).to(torch.float8_e4m3fn)
    return data, exponent.to(torch.uint8)


def encode_nvfp4(w: torch.Tensor):
    rows, cols = w.shape
    scale_2 = w.abs().amax() / (448 * 6)
    block = (w.view(rows, cols // 16, 16).abs().amax(-1) / 6 / scale_2).to(torch.float8_e4m3fn)
    scaled = w.view(rows, cols // 16, 16) / (block.float() * scale_2).unsqueeze(-1)
    table = torch.tensor(E2M1_VALUES)
    codes = (scaled.reshape(rows, cols, 1) - table).abs().argmin(-1).to(torch.uint8)
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]  # first value in the high nibble
    return packed, block, scale_2, codes


def marker(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


@pytest.fixture(scope="module")
def comfy_file(tiny, tmp_path_factory):
    """The tiny DiT as ComfyUI would repackage it, one layout per kind of layer, with the
    ComfyUI key prefix and embedded text embeddings; plus what each layer must decode to."""
    state, config, _ = tiny
    out, expect = {}, {}
    for key, w in state.items():
        layer = key[: -len(".weight")]
        if not is_big_weight(key, w):
            out[key] = w
        elif ".proj_qkv." in key:
            q, scale = encode_convrot(w, 64)
            out.update({key: q, f"{layer}.weight_scale": scale,
                        f"{layer}.comfy_quant": marker({"format": "int8_tensorwise", "convrot": True,
                                                        "convrot_groupsize": 64})})
            expect[layer] = ("int8_convrot", w)
        elif ".mlp." in key and ".proj_out." not in key:
            data, exponent = encode_mxfp8(w)
            out.update({key: data, f"{layer}.comfy_quant": marker({"format": "mxfp8"}),
                        f"{layer}.weight_scale":
                            swizzle_block_scales(exponent).view(torch.float8_e8m0fnu)})
            expect[layer] = ("mxfp8", data.float().view(w.shape[0], -1, 32)
                             * torch.exp2(exponent.float() - 127).unsqueeze(-1))
        elif ".proj_out." in key:
            packed, block, scale_2, codes = encode_nvfp4(w)
            out.update({key: packed, f"{layer}.weight_scale": swizzle_block_scales(block),
                        f"{layer}.weight_scale_2": scale_2,
                        f"{layer}.comfy_quant": marker({"format": "nvfp4"})})
            expect[layer] = ("nvfp4", torch.tensor(E2M1_VALUES)[codes.long()].view(w.shape[0], -1, 16)
                             * (block.float() * scale_2).unsqueeze(-1))
        else:
            raise AssertionError(key)
    pos = torch.randn(1, 7, 64)
    out["positive_conditioning"], out["negative_conditioning"] = pos, torch.zeros(1, 3, 64)
    path = tmp_path_factory.mktemp("comfy") / "seedvr2_3b_comfy.safetensors"
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in out.items()}, path,
              metadata={"config": config})
    return path, expect, pos


def test_comfy_layouts_decode_exactly(comfy_file):
    path, expect, _ = comfy_file
    model = load_dit(path, dtype=torch.float32)
    packed = packed_modules(model)
    assert {name: p.label for name, p in packed.items()} == \
        {name: scheme for name, (scheme, _) in expect.items()}
    for name, (scheme, expected) in expect.items():
        weight = model.get_submodule(name).weight
        if scheme == "int8_convrot":  # rotated back: the original weight within int8 rounding
            # Each rotated entry errs by at most half a step (its row's scale / 2); rotating
            # back sums 64 of them with weights +-1/8, so a weight errs by at most 8 half-steps.
            _, scale = encode_convrot(expected, 64)
            torch.testing.assert_close(weight, expected, atol=8 * scale.max().item() / 2, rtol=0)
        else:  # exactly the documented decode of the stored codes and scales
            assert torch.equal(weight, expected.reshape(weight.shape)), name


def test_comfy_file_runs_and_carries_text_embeddings(tiny, reference, comfy_file, tmp_path):
    _, _, case = tiny
    path, _, pos = comfy_file
    model = load_dit(path, dtype=torch.float32)
    error = relative_error(dit_output(model, case), reference[1])
    print(f"DiT 3B tiny, ComfyUI int8_convrot/mxfp8/nvfp4 weights: relative error {error:.2e}")
    # Per layer: int8 over 64-weight rotation groups, e4m3 (3 mantissa bits), e2m1 (1 bit):
    # bound 0.42, measured 4e-2.
    scheme_error = {"int8_convrot": integer_step_error(127, 64), "mxfp8": float_step_error(3),
                    "nvfp4": float_step_error(1)}
    assert error < quantization_bound([scheme_error[p.label] for p in packed_modules(model).values()])
    assert torch.equal(model.embedded_text_embeddings["pos"], pos)
    text = load_text_embeddings("auto", 64, tmp_path, embedded=model.embedded_text_embeddings["pos"],
                                source=path)
    assert torch.equal(text, pos[0])
    with pytest.raises(CheckpointError, match=r"seedvr2_3b_comfy\.safetensors: text embeddings have "
                                              r"width 64 but the DiT expects txt_in_dim 5120"):
        load_text_embeddings("auto", 5120, tmp_path, embedded=pos, source=path)
    assert describe(path)["dtypes"] == ["float32", "int8_convrot", "mxfp8", "nvfp4"]


def test_block_scale_swizzle_round_trip():
    plain = torch.arange(200 * 7, dtype=torch.int32).view(200, 7)
    blocked = swizzle_block_scales(plain)
    assert blocked.shape == (256, 8)
    # cuBLAS layout: tiles of 128x4 stored one after the other as 32 lines of 16; row r of a
    # tile goes to line r % 32, columns 4 * (r // 32) ... + 3.
    tiles = blocked.reshape(2, 2, 32, 16)
    assert tiles[0, 0, 5, 4 * 2 + 3].item() == plain[5 + 64, 3].item()
    assert tiles[1, 1, 3, 4 * 1 + 2].item() == plain[128 + 3 + 32, 4 + 2].item()
    assert torch.equal(unswizzle_block_scales(blocked, 200, 7), plain)


def test_regular_hadamard_is_its_own_inverse():
    h = regular_hadamard(256)
    # Entries +-1/16: each product entry sums 256 terms of magnitude 1/256 (total 1).
    torch.testing.assert_close(h @ h, torch.eye(256), atol=rounding_bound(1.0, terms=256), rtol=0)
    assert torch.equal(h, h.T)
    with pytest.raises(ValueError, match="power of 4"):
        regular_hadamard(128)


L = "blocks.0.attn.proj_qkv.vid"  # 384 x 128


def _int8_layer(state):
    from seedvr2.loading.int8 import quantize_int8_rows

    codes, scale = quantize_int8_rows(state[f"{L}.weight"])
    return {f"{L}.weight": codes, f"{L}.weight_scale": scale}


@pytest.mark.parametrize("change, message", [
    ({f"{L}.weight_scale": torch.ones(384, 1, dtype=torch.int32)},
     f"tensor '{L}.weight_scale': expected float32 or float16 or bfloat16 of shape [] or [1] or "
     f"[384] or [384, 1]; found int32 [384, 1] (int8_rows)"),
    ({f"{L}.weight_scale": torch.ones(384, 1, dtype=torch.bool)},
     f"tensor '{L}.weight_scale': expected float32 or float16 or bfloat16 of shape [] or [1] or "
     f"[384] or [384, 1]; found bool [384, 1] (int8_rows)"),
    ({f"{L}.weight_scale": torch.ones(385)},
     f"tensor '{L}.weight_scale': expected float32 or float16 or bfloat16 of shape [] or [1] or "
     f"[384] or [384, 1]; found float32 [385] (int8_rows)"),
    ({f"{L}.comfy_quant": marker({"format": "int8_tensorwise", "convrot": True,
                                  "convrot_groupsize": 2})},
     f"tensor '{L}.comfy_quant': convrot_groupsize must be a power of 4 (4, 16, 64, 256, ...); "
     f"found 2"),
    ({f"{L}.comfy_quant": marker({"format": "int8_tensorwise", "convrot": True,
                                  "convrot_groupsize": 0})},
     f"tensor '{L}.comfy_quant': convrot_groupsize must be a power of 4 (4, 16, 64, 256, ...); "
     f"found 0"),
    ({f"{L}.comfy_quant": marker({"format": "int8_tensorwise", "convrot": True,
                                  "convrot_groupsize": None})},
     f"tensor '{L}.comfy_quant': convrot_groupsize must be a power of 4 (4, 16, 64, 256, ...); "
     f"found None"),
    ({f"{L}.comfy_quant": marker(["int8_tensorwise"])},
     f"tensor '{L}.comfy_quant': expected a JSON object with a 'format' string; found "
     f"[\"int8_tensorwise\"]"),
    ({f"{L}.comfy_quant": torch.tensor(list(b"[" * 5000 + b"]" * 5000), dtype=torch.uint8)},
     f"tensor '{L}.comfy_quant' is not a JSON quantisation config (nested too deeply)"),
    ({f"{L}.weight_scale": torch.tensor([float("nan")] * 384).reshape(384, 1)},
     f"tensor '{L}.weight_scale' holds NaN or infinite values; the file is damaged (re-download "
     f"or re-convert it)"),
])
def test_bad_layouts_are_refused_at_load_naming_tensor_expected_and_found(tiny, tmp_path, change,
                                                                          message):
    """What used to load and change the picture (an int32 or bool scale), end in a bare
    'shape [384, 1] is invalid' or only fail at the first forward pass (a ConvRot group of 2),
    or end in a TypeError/RecursionError/ZeroDivisionError traceback, is one error at load
    naming the file, the tensor, what was expected and what was found."""
    state, config, _ = tiny
    path = tmp_path / "bad.safetensors"
    save_file({**state, **_int8_layer(state),
               f"{L}.comfy_quant": marker({"format": "int8_tensorwise"}), **change}, path,
              metadata={"config": config})
    with pytest.raises(CheckpointError) as refused:
        load_dit(path)
    assert str(refused.value) == f"{path}: {message}"


def test_a_layers_table_that_is_not_a_table_is_refused(tiny, tmp_path):
    state, config, _ = tiny
    path = tmp_path / "table.safetensors"
    save_file({**state, **_int8_layer(state)}, path, metadata={
        "config": config, "_quantization_metadata": json.dumps({"layers": [L]})})
    with pytest.raises(CheckpointError, match=re.escape(
            f"{path}: metadata entry '_quantization_metadata': expected an object whose 'layers' "
            f"maps layer names to configs; found [\"{L}\"]")):
        describe(path)


def test_unknown_comfy_format_names_layer(tiny, tmp_path):
    state, config, _ = tiny
    path = tmp_path / "w4a8.safetensors"
    layer = "blocks.0.attn.proj_out.vid"
    save_file(dict(state, **{f"{layer}.comfy_quant": marker({"format": "asym_w4a8_int8"})}), path,
              metadata={"config": config})
    with pytest.raises(CheckpointError, match=r"w4a8\.safetensors: layer 'blocks\.0\.attn\.proj_out"
                                              r"\.vid' uses the quantisation format 'asym_w4a8_int8', "
                                              r"which this loader cannot dequantise"):
        load_dit(path)


def test_missing_scale_names_tensor(tiny, tmp_path):
    state, config, _ = tiny
    path = tmp_path / "noscale.safetensors"
    layer = "blocks.0.attn.proj_out.vid"
    save_file(dict(state, **{f"{layer}.weight": state[f"{layer}.weight"].to(torch.int8),
                             f"{layer}.comfy_quant": marker({"format": "int8_tensorwise"})}),
              path, metadata={"config": config})
    with pytest.raises(CheckpointError, match=r"noscale\.safetensors: layer 'blocks\.0\.attn\.proj_out"
                                              r"\.vid' is marked int8_tensorwise but has no tensor "
                                              r"'blocks\.0\.attn\.proj_out\.vid\.weight_scale'"):
        load_dit(path)


# ---------------------------------------------------------------------------------------------
# registry: downloads, hashes, model names


@pytest.fixture
def fake_hub(monkeypatch):
    """hf_hub_download replaced by a function that writes `payload` (or raises `error`), and
    the hub taken as reachable."""
    import huggingface_hub

    calls = {"payload": b"weights", "error": None, "args": []}

    def fake(repo_id, filename, local_dir, **kwargs):
        calls["args"].append((repo_id, filename))
        if calls["error"]:
            raise calls["error"]
        path = local_dir / filename
        path.write_bytes(calls["payload"])
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    monkeypatch.setattr(registry, "hub_unreachable", lambda: None)  # the fake hub answers
    return calls


def test_download_verifies_sha256(fake_hub, monkeypatch, tmp_path):
    name = "seedvr2_ema_3b_fp16.safetensors"
    sha = hashlib.sha256(b"weights").hexdigest()
    monkeypatch.setitem(registry.KNOWN_FILES, name,
                        registry.KnownFile("dit", "numz/SeedVR2_comfyUI", "3b", "fp16", sha))
    assert registry.download(name, tmp_path) == tmp_path / name
    assert fake_hub["args"] == [("numz/SeedVR2_comfyUI", name)]
    assert registry.resolve_model_file(name, tmp_path, "dit") == tmp_path / name


def test_download_of_a_file_in_a_repository_folder(fake_hub, tmp_path):
    """Comfy-Org/SeedVR2 keeps its files in diffusion_models/ and vae/: asked there, saved in
    the model folder under its name."""
    fake_hub["payload"] = b""
    name = "seedvr2_3b_int8_convrot.safetensors"
    (tmp_path / "diffusion_models").mkdir()
    assert registry.download(name, tmp_path) == tmp_path / name
    assert fake_hub["args"] == [("Comfy-Org/SeedVR2", f"diffusion_models/{name}")]
    assert (tmp_path / name).is_file()


def test_download_with_wrong_hash_is_not_used(fake_hub, tmp_path):
    name = "ema_vae_fp16.safetensors"
    with pytest.raises(CheckpointError, match=r"ema_vae_fp16\.safetensors: sha256 [0-9a-f]{64} does "
                                              r"not match the released file \(20678548"):
        registry.resolve_model_file(name, tmp_path, "vae", download_missing=True)
    assert not (tmp_path / name).exists() and (tmp_path / f"{name}.corrupt").exists()


def test_download_offline_names_file_url_and_folder(fake_hub, tmp_path):
    fake_hub["error"] = ConnectionError("Failed to resolve 'huggingface.co'")
    with pytest.raises(CheckpointError, match=r"^seedvr2_ema_7b_fp16\.safetensors: download from "
                                              r"https://huggingface\.co/numz/SeedVR2_comfyUI/resolve/"
                                              r"main/seedvr2_ema_7b_fp16\.safetensors failed \(Failed "
                                              r"to resolve 'huggingface\.co'\); download it by other "
                                              rf"means and put it in {tmp_path}"):
        registry.download("seedvr2_ema_7b_fp16.safetensors", tmp_path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "a/../../b.gguf",
                                  "~/model.gguf", "C:\\models\\x.gguf", "sub\\..\\..\\x.gguf"])
def test_model_names_cannot_leave_the_model_folder(name, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is not a file name inside the model folder"):
        registry.resolve_model_file(name, folder, "dit", allow_paths=False)


def test_model_names_in_subfolders_and_explicit_paths(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.gguf").write_bytes(b"x")
    assert registry.resolve_model_file("sub/mine.gguf", tmp_path, allow_paths=False) == \
        tmp_path / "sub" / "mine.gguf"
    # An explicit path (command line) may be anywhere.
    assert registry.resolve_model_file(str(tmp_path / "sub" / "mine.gguf"), tmp_path / "other") == \
        tmp_path / "sub" / "mine.gguf"


def test_loading_imports_neither_gguf_nor_hub():
    code = ("import sys, seedvr2.loading, seedvr2.loading.registry, seedvr2.cli; "
            "print(sorted(m for m in ('gguf', 'huggingface_hub') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_registry_facts_are_well_formed():
    for name, known in registry.KNOWN_FILES.items():
        assert known.kind in ("dit", "vae", "text") and "/" in known.repo
        assert known.sha256 is None or len(known.sha256) == 64 and int(known.sha256, 16) >= 0
        # Every weight file's download size can be told (formats and families all known).
        assert known.kind == "text" or re.fullmatch(r"about \d+\.\d GB", registry.approximate_size(name))


def test_registry_knows_comfyui_native_files_and_their_folders():
    """ComfyUI's native SeedVR2 files (Comfy-Org/SeedVR2): names, repository folders, the
    ComfyUI folders their users keep them in, and download sizes."""
    native = {name: known for name, known in registry.KNOWN_FILES.items()
              if known.repo == "Comfy-Org/SeedVR2"}
    dits = {f"seedvr2_{m}_{f}.safetensors" for m in ("3b", "7b", "7b_sharp")
            for f in ("fp16", "fp8_e4m3fn", "int8_convrot", "mxfp8", "nvfp4")}
    assert set(native) == dits | {"seedvr2_ema_vae_fp16.safetensors"}
    assert registry.download_url("seedvr2_7b_sharp_nvfp4.safetensors") == (
        "https://huggingface.co/Comfy-Org/SeedVR2/resolve/main/diffusion_models/"
        "seedvr2_7b_sharp_nvfp4.safetensors")
    assert registry.download_url("seedvr2_ema_vae_fp16.safetensors") == (
        "https://huggingface.co/Comfy-Org/SeedVR2/resolve/main/vae/seedvr2_ema_vae_fp16.safetensors")
    assert {(k.kind, k.comfy_folder) for n, k in native.items() if n in dits} == \
        {("dit", "diffusion_models")}
    assert native["seedvr2_ema_vae_fp16.safetensors"].comfy_folder == "vae"
    assert registry.KNOWN_FILES["seedvr2_7b_sharp_mxfp8.safetensors"].family == "7b"
    assert registry.approximate_size("seedvr2_3b_nvfp4.safetensors") == "about 1.9 GB"
