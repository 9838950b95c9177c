"""Known released SeedVR2 files, where model files live on this machine, and downloads.

A model is named either by a registered file name (looked up in the model folder) or by a path.
Registered names never contain folders, so a name cannot reach outside the model folder; other
names from workflows are checked by :func:`model_path_in` (``allow_paths=False``), and only
an explicit path on the command line may point elsewhere.

:func:`download` fetches a registered file with ``huggingface_hub`` (resumable) into the model
folder and accepts it only when its sha256 matches the registry.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .formats import CheckpointError


@dataclass(frozen=True)
class KnownFile:
    kind: str  # "dit", "vae" or "text"
    repo: str  # Hugging Face repository
    family: Optional[str] = None  # "3b" / "7b" for DiTs
    format: str = "fp16"
    sha256: Optional[str] = None
    size: Optional[int] = None  # bytes, when known


_NUMZ, _AINVFX, _OFFICIAL = "numz/SeedVR2_comfyUI", "AInVFX/SeedVR2_comfyUI", "ByteDance-Seed/SeedVR2-3B"

KNOWN_FILES: dict[str, KnownFile] = {
    "seedvr2_ema_3b_fp16.safetensors": KnownFile("dit", _NUMZ, "3b", "fp16",
        "2fd0e03a3dad24e07086750360727ca437de4ecd456f769856e960ae93e2b304"),
    "seedvr2_ema_3b_fp8_e4m3fn.safetensors": KnownFile("dit", _NUMZ, "3b", "fp8_e4m3fn",
        "3bf1e43ebedd570e7e7a0b1b60d6a02e105978f505c8128a241cde99a8240cff"),
    "seedvr2_ema_3b-Q4_K_M.gguf": KnownFile("dit", _AINVFX, "3b", "Q4_K_M",
        "e665e3909de1a8c88a69c609bca9d43ff5a134647face2ce4497640cc3597f0e"),
    "seedvr2_ema_3b-Q8_0.gguf": KnownFile("dit", _AINVFX, "3b", "Q8_0",
        "be0d60083a2051a265eb4b77f28edf494e6db67ffc250216f32b72292e5cbd96"),
    "seedvr2_ema_7b_fp16.safetensors": KnownFile("dit", _NUMZ, "7b", "fp16",
        "7b8241aa957606ab6cfb66edabc96d43234f9819c5392b44d2492d9f0b0bbe4a"),
    "seedvr2_ema_7b_fp8_e4m3fn_mixed_block35_fp16.safetensors": KnownFile(
        "dit", _AINVFX, "7b", "fp8_e4m3fn_mixed_block35_fp16",
        "3d68b5ec0b295ae28092e355c8cad870edd00b817b26587d0cb8f9dd2df19bb2"),
    "seedvr2_ema_7b-Q4_K_M.gguf": KnownFile("dit", _AINVFX, "7b", "Q4_K_M",
        "db9cb2ad90ebd40d2e8c29da2b3fc6fd03ba87cd58cbadceccca13ad27162789"),
    "seedvr2_ema_7b_sharp_fp16.safetensors": KnownFile("dit", _NUMZ, "7b", "fp16",
        "20a93e01ff24beaeebc5de4e4e5be924359606c356c9c51509fba245bd2d77dd"),
    "seedvr2_ema_7b_sharp_fp8_e4m3fn_mixed_block35_fp16.safetensors": KnownFile(
        "dit", _AINVFX, "7b", "fp8_e4m3fn_mixed_block35_fp16",
        "0d2c5b8be0fda94351149c5115da26aef4f4932a7a2a928c6f184dda9186e0be"),
    "seedvr2_ema_7b_sharp-Q4_K_M.gguf": KnownFile("dit", _AINVFX, "7b", "Q4_K_M",
        "7aed800ac4eb8e0d18569a954c0ff35f5a1caa3ed5d920e66cc31405f75b6e69"),
    "ema_vae_fp16.safetensors": KnownFile("vae", _NUMZ, None, "fp16",
        "20678548f420d98d26f11442d3528f8b8c94e57ee046ef93dbb7633da8612ca1"),
    "pos_emb.pt": KnownFile("text", _OFFICIAL, None, "bf16"),
    "neg_emb.pt": KnownFile("text", _OFFICIAL, None, "bf16"),
}

DEFAULT_DIT = "seedvr2_ema_3b_fp16.safetensors"
DEFAULT_VAE = "ema_vae_fp16.safetensors"
COMFY_FOLDER = "SEEDVR2"  # ComfyUI's models/SEEDVR2


def default_model_dir() -> Path:
    """``$SEEDVR2_MODEL_DIR``, else ComfyUI's models/SEEDVR2 when running inside ComfyUI, else
    the user cache folder (``$XDG_CACHE_HOME/seedvr2/models`` or ``~/.cache/seedvr2/models``)."""
    if os.environ.get("SEEDVR2_MODEL_DIR"):
        return Path(os.environ["SEEDVR2_MODEL_DIR"]).expanduser()
    try:
        import folder_paths  # ComfyUI's module; present only inside ComfyUI

        return Path(folder_paths.models_dir) / COMFY_FOLDER
    except ImportError:
        pass
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "seedvr2" / "models"


def download_url(name: str) -> str:
    known = KNOWN_FILES[name]
    return f"https://huggingface.co/{known.repo}/resolve/main/{name}"


def model_path_in(model_dir, name: str) -> Path:
    """``model_dir / name`` for a model name from a workflow or a node: relative, no ``..``.

    Sub-folders are allowed (ComfyUI lists ``sub/file.safetensors``); absolute paths, drive
    letters, ``~`` and ``..`` components are refused, so a name cannot leave the folder.
    """
    text = str(name)
    parts = text.replace("\\", "/").split("/")
    if not text or text.startswith(("/", "\\", "~")) or ":" in text or \
            any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"model name {text!r} is not a file name inside the model folder "
                              f"{model_dir} (names may not be absolute or contain '..')")
    return Path(model_dir).joinpath(*parts)


def resolve_model_file(spec, model_dir=None, kind: str = "dit", *, allow_paths: bool = True,
                       download_missing: bool = False) -> Path:
    """A model given by registered name (looked up in the model folder) or by path.

    ``allow_paths=False`` (names from workflows) accepts only names inside ``model_dir``;
    ``download_missing=True`` fetches a registered file that is not there yet.
    """
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    spec_str = str(spec)
    if allow_paths:
        path = Path(spec_str).expanduser()
        if path.is_file():
            return path
    else:
        inside = model_path_in(model_dir, spec_str)
        if inside.is_file():
            return inside
    if spec_str in KNOWN_FILES:
        candidate = model_dir / spec_str
        if candidate.is_file():
            return candidate
        if download_missing:
            return download(spec_str, model_dir)
        raise CheckpointError(f"{kind.upper()} model {spec_str!r} is not in the model folder "
                              f"{model_dir}: download it from {download_url(spec_str)} and put "
                              f"it there (or pass --model-dir)")
    if (model_dir / spec_str).is_file() and Path(spec_str).name == spec_str:
        return model_dir / spec_str
    known = ", ".join(n for n, k in KNOWN_FILES.items() if k.kind == kind)
    raise CheckpointError(f"{kind.upper()} model {spec_str!r} not found: not a file, and not a "
                          f"registered name (registered: {known}) nor a file in {model_dir}")


def sha256_of(path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path, name: str) -> None:
    """Raise (and move the file aside as ``<name>.corrupt``) when its sha256 is not the
    registry's; a file without a registered hash passes."""
    expected = KNOWN_FILES[name].sha256
    if expected is None:
        return
    actual = sha256_of(path)
    if actual != expected:
        bad = Path(path).with_name(Path(path).name + ".corrupt")
        os.replace(path, bad)
        raise CheckpointError(f"{path}: sha256 {actual} does not match the released file "
                              f"({expected}); it was moved to {bad.name} and is not used. "
                              f"Download it again from {download_url(name)}")


def download(name: str, model_dir=None) -> Path:
    """Fetch the registered file ``name`` into ``model_dir`` and verify its sha256.

    ``huggingface_hub`` resumes an interrupted download (its partial file stays in
    ``model_dir/.cache``). Without a connection the error names the file, its URL and the
    folder to put it in.
    """
    if name not in KNOWN_FILES:
        known = ", ".join(KNOWN_FILES)
        raise CheckpointError(f"{name!r} is not a released SeedVR2 file (known: {known})")
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    target = model_dir / name
    if target.is_file():
        verify_file(target, name)
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise CheckpointError(f"{name}: downloading needs the 'huggingface_hub' package; or "
                              f"download {download_url(name)} yourself into {model_dir}") from None
    try:
        fetched = Path(hf_hub_download(repo_id=KNOWN_FILES[name].repo, filename=name,
                                       local_dir=model_dir))
    except Exception as e:  # offline, DNS, HTTP errors, missing repository: all end here
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{name}: download from {download_url(name)} failed ({detail}); "
                              f"download it by other means and put it in {model_dir}") from None
    if fetched.resolve() != target.resolve():
        os.replace(fetched, target)
    verify_file(target, name)
    return target
