"""``text_embeddings=auto`` with nothing but a DiT and a VAE in the model folder: the package's
official embeddings are used for DiTs of the released text width (5120)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import seedvr2
from seedvr2.loading.weight_files import CheckpointError
from seedvr2.loading.text import BUNDLED_TEXT_EMBEDDINGS, load_text_embeddings
from seedvr2.models import build_dit

from conftest import constructor_kwargs

OFFICIAL_WIDTH = 5120  # txt_in_dim of both released families (conformance README section 2)


def test_auto_falls_back_to_the_bundled_embeddings(tmp_path):
    official = load_file(BUNDLED_TEXT_EMBEDDINGS)["pos"]
    pos = load_text_embeddings("auto", OFFICIAL_WIDTH, tmp_path)
    assert pos.dtype == torch.float32 and torch.equal(pos, official.float())
    # A file of the right width in the model folder is the user's choice and comes first.
    own = torch.randn(7, OFFICIAL_WIDTH)
    save_file({"pos": own}, tmp_path / "my_text.safetensors")
    assert torch.equal(load_text_embeddings("auto", OFFICIAL_WIDTH, tmp_path), own)
    with pytest.raises(CheckpointError, match=r"no text embeddings of width 64 .*found "
                                              r"my_text.safetensors \(5120\), the bundled"):
        load_text_embeddings("auto", 64, tmp_path)


@pytest.fixture(scope="module")
def official_width_models(conformance, tmp_path_factory):
    """A model folder with only a tiny DiT of the released text width and the tiny VAE."""
    folder = tmp_path_factory.mktemp("dit_and_vae_only")
    config = dict(constructor_kwargs(conformance / "dit3b_tiny"), txt_in_dim=OFFICIAL_WIDTH)
    torch.manual_seed(0)
    dit = build_dit(config)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, folder / "dit.safetensors",
              metadata={"config": json.dumps(config)})
    save_file(load_file(conformance / "vae_tiny" / "weights.safetensors"), folder / "vae.safetensors",
              metadata={"config": json.dumps(constructor_kwargs(conformance / "vae_tiny"))})
    return folder


def test_upscale_runs_with_only_dit_and_vae(official_width_models):
    folder = official_width_models
    frames = torch.rand(1, 24, 32, 3, generator=torch.Generator().manual_seed(0))
    out = seedvr2.upscale(frames, str(folder / "dit.safetensors"), str(folder / "vae.safetensors"),
                          model_dir=folder, device="cpu", dtype="fp32", resolution=32)
    assert out.shape == (1, 32, 42, 3) and torch.isfinite(out).all()
    assert sorted(p.name for p in folder.iterdir()) == ["dit.safetensors", "vae.safetensors"]


def test_wheel_carries_the_embeddings(tmp_path):
    """Installed from a wheel (not this checkout), the package still finds them."""
    import subprocess
    import sys
    import zipfile

    from conftest import REPO

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(REPO)], check=True,
                   timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    inside = "seedvr2/" + str(BUNDLED_TEXT_EMBEDDINGS.relative_to(BUNDLED_TEXT_EMBEDDINGS.parents[1]))
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(inside) == BUNDLED_TEXT_EMBEDDINGS.read_bytes()
