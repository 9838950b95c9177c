"""The ``seedvr2`` command and importing the pack the ways ComfyUI and users do."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from seedvr2.cli import main

from conftest import REPO, custom_node_import


def test_inspect_prints_family_size_dtype(conformance, capsys):
    assert main(["inspect", str(conformance / "dit3b_tiny" / "weights.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "DiT, 3B family: vid_dim 128, 2 heads x 64, 4 layers, mm_layers 2, txt_in_dim 64" in out
    assert "safetensors, dtype float32, 1,761,472 parameters in 103 tensors" in out


def test_inspect_json_and_bad_file(conformance, capsys):
    rc = main(["inspect", "--json", str(conformance / "dit7b_tiny" / "weights.safetensors"),
               str(conformance / "index.json")])
    captured = capsys.readouterr()
    assert rc == 1
    info = json.loads(captured.out.splitlines()[0])
    assert (info["family"], info["parameters"], info["mlp_type"]) == ("7b", 1768256, "normal")
    assert "index.json: unrecognised weight file" in captured.err


def test_python_dash_m(conformance):
    result = subprocess.run([sys.executable, "-m", "seedvr2", "inspect",
                             str(conformance / "dit7b_tiny" / "weights.safetensors")],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "7B family" in result.stdout


def _run_isolated(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, cwd="/")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_seedvr2_is_light():
    out = _run_isolated("""
        import sys, seedvr2
        print(sorted(m for m in ("torch", "safetensors", "seedvr2.models") if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_pack_loads_as_comfyui_custom_node_folder(tmp_path):
    """ComfyUI imports the folder by path under its own (any) name -- the folder path with "."
    replaced by "_x_" -- and nothing heavy may load: no PyAV, gguf, huggingface_hub, no model
    code, not even torch (so no CUDA context)."""
    folder = tmp_path / "custom_nodes" / "ComfyUI-SeedVR2.my-copy"
    folder.parent.mkdir()
    folder.symlink_to(REPO, target_is_directory=True)
    out = _run_isolated(custom_node_import(folder) + textwrap.dedent("""
        heavy = [m for m in sys.modules if m.split(".")[0] in ("av", "gguf", "huggingface_hub", "torch")
                 or m.endswith("seedvr2.models") or m == "seedvr2"]
        print(type(module.NODE_CLASS_MAPPINGS).__name__, heavy)
        print(sorted(module.NODE_CLASS_MAPPINGS))
        # The library inside the pack works through relative imports alone.
        import torch
        models = importlib.import_module(spec.name + ".src.seedvr2.models")
        with torch.device("meta"):
            print(sum(p.numel() for p in models.build_dit("7b").parameters()),
                  "seedvr2" in sys.modules, torch.cuda.is_initialized())
    """))
    assert out.split("\n")[:3] == [
        "dict []",
        "['SeedVR2LoadDiTModel', 'SeedVR2LoadVAEModel', 'SeedVR2TorchCompileSettings', "
        "'SeedVR2UpscaleVideo', 'SeedVR2UpscaleVideoFile', 'SeedVR2VideoUpscaler']",
        "8239607872 False False"]


def test_pack_init_as_a_plain_module_defines_nothing():
    """pytest collecting a checkout whose folder name is no identifier (ComfyUI-SeedVR2)
    imports the top-level __init__.py as a plain module, where relative imports cannot work:
    it must import cleanly and define no nodes (ComfyUI always imports it as a package)."""
    out = _run_isolated(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("__init__", {str(REPO / "__init__.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(hasattr(module, "NODE_CLASS_MAPPINGS"))
    """)
    assert out.strip() == "False"
