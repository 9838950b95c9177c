"""Shared test fixtures. The conformance kit (``../shared/conformance``) is the contract: when it
is missing the tests fail loudly instead of skipping."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]


def conformance_dir() -> Path:
    path = Path(os.environ.get("SEEDVR2_CONFORMANCE") or REPO.parent / "shared" / "conformance")
    if not (path / "index.json").is_file():
        pytest.fail(f"conformance kit not found at {path} (expected index.json there); "
                    f"set SEEDVR2_CONFORMANCE to its folder")
    return path


@pytest.fixture(scope="session")
def conformance() -> Path:
    return conformance_dir()


def load_case(family_dir: Path, name: str) -> dict:
    return load_file(family_dir / "cases" / f"{name}.safetensors")


def constructor_kwargs(family_dir: Path) -> dict:
    return json.loads((family_dir / "config.json").read_text())["constructor_kwargs"]


@pytest.fixture(scope="session")
def tiny_model_dir(conformance, tmp_path_factory) -> Path:
    """A model folder holding the tiny 3B DiT, the tiny VAE (with their configs in the metadata)
    and 64-wide text embeddings: what the pipeline tests load by path."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("models")
    for name in ("dit3b_tiny", "vae_tiny"):
        save_file(load_file(conformance / name / "weights.safetensors"), folder / f"{name}.safetensors",
                  metadata={"config": json.dumps(constructor_kwargs(conformance / name))})
    e2e = load_file(conformance / "pipeline" / "e2e_video_9f.safetensors")
    save_file({"pos": e2e["inputs.txt_pos"].contiguous(), "neg": e2e["inputs.txt_neg"].contiguous()},
              folder / "text_64.safetensors")
    return folder


@pytest.fixture(scope="session")
def tiny_options(tiny_model_dir) -> dict:
    """Options + model arguments for upscaling with the tiny models on the CPU in fp32."""
    return dict(dit=str(tiny_model_dir / "dit3b_tiny.safetensors"),
                vae=str(tiny_model_dir / "vae_tiny.safetensors"), model_dir=tiny_model_dir,
                device="cpu", dtype="fp32")
