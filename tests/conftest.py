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
