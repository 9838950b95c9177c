"""The vendored conformance kit and the bundled text embeddings are the files the kit's index
describes, and a missing kit stops the session once, at start."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

from conftest import REPO, VENDORED_CONFORMANCE


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_vendored_files_are_the_kit_unchanged():
    index = json.loads((VENDORED_CONFORMANCE / "index.json").read_text())["files"]
    vendored = sorted(str(p.relative_to(VENDORED_CONFORMANCE)) for p in VENDORED_CONFORMANCE.rglob("*")
                      if p.is_file() and p.name not in ("index.json", "README.md", "PROVENANCE.md"))  # not indexed
    assert vendored, "tests/conformance is empty"
    for name in vendored:
        assert name in index, f"{name} is not a file of the conformance kit"
        path = VENDORED_CONFORMANCE / name
        assert (path.stat().st_size, _sha256(path)) == (index[name]["bytes"], index[name]["sha256"]), name
    # What is left out is said in PROVENANCE.md (the embeddings ship with the package).
    left_out = sorted(set(index) - set(vendored))
    assert left_out == ["text_embeddings.json", "text_embeddings.safetensors"]


def test_bundled_text_embeddings_are_the_official_ones():
    from safetensors.torch import load_file

    from seedvr2.loading.text import BUNDLED_TEXT_EMBEDDINGS

    index = json.loads((VENDORED_CONFORMANCE / "index.json").read_text())
    entry = index["files"]["text_embeddings.safetensors"]
    assert (BUNDLED_TEXT_EMBEDDINGS.stat().st_size, _sha256(BUNDLED_TEXT_EMBEDDINGS)) == \
        (entry["bytes"], entry["sha256"])
    tensors = load_file(BUNDLED_TEXT_EMBEDDINGS)
    for key, facts in index["parts"]["text"].items():
        assert list(tensors[key].shape) == facts["shape"] and str(tensors[key].dtype) == "torch.bfloat16"
        assert tensors[key].float().abs().max().item() == facts["absmax"]


def test_missing_kit_is_one_error_at_start(tmp_path):
    missing = tmp_path / "no_kit"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/test_vae.py", "tests/test_dit.py"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "SEEDVR2_CONFORMANCE": str(missing)})
    output = result.stdout + result.stderr
    assert result.returncode == 4, output  # pytest's usage error: nothing was collected or run
    assert output.count("conformance kit not found") == 1, output
    assert f"{missing} ($SEEDVR2_CONFORMANCE; expected index.json there)" in output
    assert " passed" not in output and " failed" not in output
