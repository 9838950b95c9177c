"""One loader for safetensors and .pth: detection, strict checks, dtype, clear errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from seedvr2.loading import CheckpointError, describe, load_dit, load_vae
from seedvr2.loading.detect import detect_dit, detect_vae
from seedvr2.models import dit_config, vae_config

from conftest import constructor_kwargs, dit_bound, dit_output, load_case, network_bound


@pytest.mark.parametrize("manifest,name", [("dit3b_full", "3b"), ("dit7b_full", "7b")])
def test_detects_full_size_dit_from_shapes(conformance, manifest, name):
    data = json.loads((conformance / "manifests" / f"{manifest}.json").read_text())
    shapes = {k: tuple(v["shape"]) for k, v in data["keys"].items()}
    assert dit_config(detect_dit(shapes)) == dit_config(name)
    without_rope = {k: v for k, v in shapes.items() if not k.endswith("rope.rope.freqs")}
    assert dit_config(detect_dit(without_rope)) == dit_config(name)


def test_detects_full_size_vae_from_shapes(conformance):
    data = json.loads((conformance / "manifests" / "vae_full.json").read_text())
    shapes = {k: tuple(v["shape"]) for k, v in data["keys"].items()}
    assert vae_config(detect_vae(shapes)) == vae_config("vae")


@pytest.mark.parametrize("family", ["dit3b_tiny", "dit7b_tiny"])
def test_metadata_config_is_enough(conformance, family, tmp_path):
    folder = conformance / family
    path = tmp_path / "tiny.safetensors"
    save_file(load_file(folder / "weights.safetensors"), path,
              metadata={"config": json.dumps(constructor_kwargs(folder))})
    model = load_dit(path)
    assert model.config == dit_config(constructor_kwargs(folder))
    case = load_case(folder, "image")
    expected = case["outputs.vid_sample"]
    torch.testing.assert_close(dit_output(model, case), expected,
                               atol=dit_bound(model, case, expected), rtol=0)


def test_metadata_config_overrides_defaults(conformance, tmp_path):
    folder = conformance / "dit3b_tiny"
    config = dict(constructor_kwargs(folder), window=[[2, 2, 2]] * 4)
    path = tmp_path / "tiny.safetensors"
    save_file(load_file(folder / "weights.safetensors"), path, metadata={"config": json.dumps(config)})
    assert load_dit(path).config.window == [(2, 2, 2)] * 4


def test_vae_needs_metadata_for_group_count(conformance, tmp_path):
    folder = conformance / "vae_tiny"
    with pytest.raises(CheckpointError, match="norm_num_groups"):
        load_vae(folder / "weights.safetensors")  # 8 groups cannot be read from the weights
    path = tmp_path / "vae.safetensors"
    save_file(load_file(folder / "weights.safetensors"), path,
              metadata={"config": json.dumps(constructor_kwargs(folder))})
    vae = load_vae(path)
    case = load_file(folder / "cases" / "image_1f.safetensors")
    with torch.no_grad():
        mean = vae.encode(case["inputs.video"])
    expected = case["outputs.posterior_mean"]
    torch.testing.assert_close(mean, expected, atol=network_bound(vae.encoder, expected), rtol=0)


def test_pth_and_missing_rope_buffers(conformance, tmp_path, caplog):
    folder = conformance / "dit7b_tiny"
    state = {k: v for k, v in load_file(folder / "weights.safetensors").items()
             if not k.endswith("rope.rope.freqs")}
    torch.save(state, tmp_path / "tiny.pth")
    with caplog.at_level(logging.INFO, logger="seedvr2"):
        model = load_dit(tmp_path / "tiny.pth")
    assert "4 RoPE frequency buffers absent from the file; recomputed" in caplog.text
    case = load_case(folder, "video_ragged")
    expected = case["outputs.vid_sample"]
    torch.testing.assert_close(dit_output(model, case), expected,
                               atol=dit_bound(model, case, expected), rtol=0)


def test_dtype_follows_file_or_request(conformance, tmp_path):
    state = load_file(conformance / "dit3b_tiny" / "weights.safetensors")
    path = tmp_path / "fp16.safetensors"
    save_file({k: v.half() for k, v in state.items()}, path)
    model = load_dit(path)
    assert model.vid_in.proj.weight.dtype == torch.float16
    assert model.blocks[0].attn.rope.rope.freqs.dtype == torch.float32
    assert load_dit(path, dtype=torch.bfloat16).txt_in.weight.dtype == torch.bfloat16
    assert describe(path)["dtypes"] == ["float16"]


# ---------------------------------------------------------------------------------------------
# bad files

@pytest.fixture(scope="module")
def dit_state(conformance):
    return load_file(conformance / "dit3b_tiny" / "weights.safetensors")


def test_wrong_family_file(conformance):
    with pytest.raises(CheckpointError, match=r"expected a SeedVR2 VAE checkpoint, but this is a DIT file"):
        load_vae(conformance / "dit3b_tiny" / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"expected a SeedVR2 DIT checkpoint, but this is a VAE file"):
        load_dit(conformance / "vae_tiny" / "weights.safetensors")


def test_other_architecture(tmp_path):
    path = tmp_path / "unet.safetensors"
    save_file({"input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3),
               "time_embed.0.weight": torch.zeros(8, 4)}, path)
    with pytest.raises(CheckpointError, match=r"unet.safetensors: expected a SeedVR2 DIT checkpoint, "
                                              r"but not a SeedVR2 model: expected DiT keys"):
        load_dit(path)


def test_missing_tensor(dit_state, tmp_path):
    path = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in dit_state.items() if k != "blocks.1.mlp.txt.proj_in.weight"}, path)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\), e\.g\. "
                                              r"\['blocks\.1\.mlp\.txt\.proj_in\.weight'\] for a 3B-family DiT"):
        load_dit(path)


def test_misshapen_tensor(dit_state, tmp_path):
    path = tmp_path / "bad.safetensors"
    save_file(dict(dit_state, **{"blocks.2.ada.all.mlp_gate": torch.zeros(127)}), path)
    with pytest.raises(CheckpointError, match=r"tensor 'blocks\.2\.ada\.all\.mlp_gate' has shape \[127\], "
                                              r"expected \[128\]"):
        load_dit(path)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickle_needing_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"weight": torch.zeros(2), "payload": _Evil()}, path)
    with pytest.raises(CheckpointError, match=r"evil\.pth: this \.pth needs code to unpickle"):
        load_dit(path)


def test_truncated_safetensors(conformance, tmp_path):
    data = (conformance / "dit3b_tiny" / "weights.safetensors").read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: truncated safetensors file"):
        load_dit(path)


def test_not_a_weight_file(conformance):
    with pytest.raises(CheckpointError, match=r"index\.json: unrecognised weight file"):
        load_dit(conformance / "index.json")


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"nothing\.safetensors: weight file not found"):
        load_dit(tmp_path / "nothing.safetensors")


def test_image_vaes_and_other_diffusion_models_are_not_seedvr2(tmp_path):
    """ComfyUI's vae/ and diffusion_models/ folders hold other families' files: an image VAE
    has the SeedVR2 VAE's tensor names but 2-D convolutions; a Flux-like DiT has no vid_in."""
    from seedvr2.loading.detect import model_kind

    assert model_kind({"encoder.conv_in.weight": (128, 3, 3, 3),
                       "decoder.conv_out.weight": (3, 128, 3, 3)}) is None
    assert model_kind({"encoder.conv_in.weight": (128, 3, 3, 3, 3),
                       "decoder.conv_out.weight": (3, 128, 3, 3, 3)}) == "vae"
    assert model_kind({"double_blocks.0.img_attn.qkv.weight": (12, 4)}) is None
    save_file({"encoder.conv_in.weight": torch.zeros(8, 3, 3, 3),
               "decoder.conv_out.weight": torch.zeros(3, 8, 3, 3)}, tmp_path / "sd_vae.safetensors")
    with pytest.raises(CheckpointError, match="not a SeedVR2 model"):
        describe(tmp_path / "sd_vae.safetensors")


def test_safetensors_with_a_128_byte_header_is_not_taken_for_a_pickle(tmp_path):
    """The header's length opens the file: 128 starts it with 0x80, a pickle's first byte.
    (torch 2.14's torch.load happens to read such a file; torch 2.11 refuses it.)"""
    import struct

    from seedvr2.loading.weight_files import open_weights, sniff_format

    values = torch.arange(6, dtype=torch.float32)
    header = json.dumps({"pos": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}})
    header = header.encode().ljust(128)
    path = tmp_path / "text.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + values.numpy().tobytes())
    assert sniff_format(path) == "safetensors"
    with open_weights(path) as src:
        assert torch.equal(src.get("pos"), values.reshape(2, 3))
