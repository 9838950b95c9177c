"""Known released SeedVR2 files, where model files live on this machine, and downloads
(``huggingface_hub``, sha256-checked). Names from workflows cannot leave the model folder."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..options import option_ref
from .format_table import bytes_per_weight
from .source import CheckpointError


COMFY_FOLDER = "SEEDVR2"  # ComfyUI's models/SEEDVR2


@dataclass(frozen=True)
class KnownFile:
    kind: str  # "dit", "vae" or "text"
    repo: str  # Hugging Face repository
    family: Optional[str] = None  # "3b" / "7b" for DiTs
    format: str = "fp16"
    sha256: Optional[str] = None
    repo_folder: str = ""  # the folder holding it in the repository ("" for the root)
    comfy_folder: str = COMFY_FOLDER  # the folder of ComfyUI's models/ its users keep it in


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

# ComfyUI's native SeedVR2 files (Comfy-Org/SeedVR2): the DiT in models/diffusion_models/, the
# VAE in models/vae/ (as numz's ema_vae_fp16.safetensors, or under the name below).
_COMFY_ORG = "Comfy-Org/SeedVR2"
KNOWN_FILES.update({
    f"seedvr2_{model}_{fmt}.safetensors": KnownFile(
        "dit", _COMFY_ORG, model[:2], fmt, repo_folder="diffusion_models",
        comfy_folder="diffusion_models")
    for model in ("3b", "7b", "7b_sharp")
    for fmt in ("fp16", "fp8_e4m3fn", "int8_convrot", "mxfp8", "nvfp4")})
KNOWN_FILES["seedvr2_ema_vae_fp16.safetensors"] = KnownFile(
    "vae", _COMFY_ORG, None, "fp16", repo_folder="vae", comfy_folder="vae")

# Parameters per model (the conformance kit's manifests of the official models).
_PARAMETERS = {"3b": 3_391_475_776, "7b": 8_239_607_872, "vae": 250_648_227}
# Bytes per weight of the files that mix formats: the mixed 7B files keep the last of 36 blocks
# in fp16 (1 + 1/36); Q4_K_M mixes Q4_K with a few Q6_K tensors, about 4.5 bits per weight.
_MIXED_BYTES = {"fp8_e4m3fn_mixed_block35_fp16": 1 + 1 / 36, "Q4_K_M": 4.5 / 8}

DEFAULT_DIT = "seedvr2_ema_3b_fp16.safetensors"
DEFAULT_VAE = "ema_vae_fp16.safetensors"


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


def _repo_path(name: str) -> str:
    folder = KNOWN_FILES[name].repo_folder
    return f"{folder}/{name}" if folder else name


def download_url(name: str) -> str:
    return f"https://huggingface.co/{KNOWN_FILES[name].repo}/resolve/main/{_repo_path(name)}"


def approximate_bytes(name: str) -> Optional[int]:
    """A registered weight file's size in bytes from its parameter count and storage format
    (what a download costs), or None when the registry cannot say."""
    known = KNOWN_FILES[name]
    params = _PARAMETERS.get(known.family or known.kind)
    per_weight = _MIXED_BYTES.get(known.format) or bytes_per_weight(known.format)
    if params is None or per_weight is None:
        return None
    return round(params * per_weight)


def approximate_size(name: str) -> Optional[str]:
    """``about 6.8 GB``: :func:`approximate_bytes` for people, or None when unknown."""
    size = approximate_bytes(name)
    return None if size is None else f"about {size / 1e9:.1f} GB"


def model_path_in(model_dir, name: str) -> Path:
    """``model_dir / name`` for a model name from a workflow or a node. Sub-folders are allowed
    (ComfyUI lists ``sub/file.safetensors``); absolute paths, drive letters, ``~`` and ``..``
    are refused, so a name cannot leave the folder."""
    text = str(name)
    parts = text.replace("\\", "/").split("/")
    if not text or text.startswith(("/", "\\", "~")) or ":" in text or \
            any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"model name {text!r} is not a file name inside the model folder "
                              f"{model_dir} (names may not be absolute or contain '..')")
    return Path(model_dir).joinpath(*parts)


class MissingModelFile(CheckpointError):
    """A registered model file that is not in the model folder (yet)."""

    def __init__(self, name: str, kind: str, model_dir: Path):
        self.name, self.kind, self.model_dir = name, kind, model_dir
        super().__init__(f"{kind.upper()} model {name!r} is not in the model folder {model_dir}")

    def describe(self) -> str:
        """``DiT seedvr2_ema_3b_fp16.safetensors (about 6.8 GB) from URL``."""
        size = approximate_size(self.name)
        size = f" ({size})" if size else ""
        return f"{_KIND_NAMES.get(self.kind, self.kind)} {self.name}{size} from {download_url(self.name)}"


_KIND_NAMES = {"dit": "DiT", "vae": "VAE", "text": "text embeddings"}


def _locate(spec, model_dir: Path, kind: str, allow_paths: bool) -> Path:
    """The file for ``spec``; else :class:`MissingModelFile` (a registered name) or
    :class:`CheckpointError`."""
    spec_str = str(spec)
    path = Path(spec_str).expanduser() if allow_paths else model_path_in(model_dir, spec_str)
    if path.is_file():
        return path
    candidate = model_dir / spec_str
    if candidate.is_file() and (spec_str in KNOWN_FILES or Path(spec_str).name == spec_str):
        return candidate
    if spec_str in KNOWN_FILES:
        raise MissingModelFile(spec_str, kind, model_dir)
    known = ", ".join(n for n, k in KNOWN_FILES.items() if k.kind == kind)
    raise CheckpointError(f"{kind.upper()} model {spec_str!r} not found: not a file, and not a "
                          f"registered name (registered: {known}) nor a file in {model_dir}")


def resolve_model_files(wanted, model_dir=None, *, allow_paths: bool = True,
                        download_missing: bool = False) -> list[Path]:
    """The files for ``wanted`` (pairs of model spec and kind), in order. A spec is a registered
    file name (looked up in the model folder) or, with ``allow_paths``, a path (without: names from
    workflows, only inside ``model_dir``). Every spec is checked before anything is downloaded:
    ``download_missing`` fetches the missing registered files when the hub answers; otherwise (or
    offline) one error names each, its size, its URL and the folder it goes in."""
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    found: list[Optional[Path]] = []
    missing: list[MissingModelFile] = []
    for spec, kind in wanted:
        try:
            found.append(_locate(spec, model_dir, kind, allow_paths))
        except MissingModelFile as e:
            if all(m.name != e.name for m in missing):
                missing.append(e)
            found.append(None)
    if missing:
        unreachable = hub_unreachable() if download_missing else None
        if not download_missing or unreachable:
            them = "it" if len(missing) == 1 else "them"
            files = "A model file is" if len(missing) == 1 else f"{len(missing)} model files are"
            offline = f" The Hugging Face hub cannot be reached ({unreachable}), so nothing " \
                f"was downloaded." if unreachable else ""
            raise CheckpointError(f"{files} missing from the model folder {model_dir}: "
                                  f"{'; '.join(m.describe() for m in missing)}.{offline} "
                                  f"Download {them} into {model_dir} (or choose another folder "
                                  f"with {option_ref('model_dir', 'FOLDER')})")
        fetched = {m.name: download(m.name, model_dir) for m in missing}
        found = [path if path is not None else fetched[str(spec)]
                 for path, (spec, _) in zip(found, wanted)]
    return found


def resolve_model_file(spec, model_dir=None, kind: str = "dit", *, allow_paths: bool = True,
                       download_missing: bool = False) -> Path:
    """One model file; see :func:`resolve_model_files`."""
    return resolve_model_files([(spec, kind)], model_dir, allow_paths=allow_paths,
                               download_missing=download_missing)[0]


# A TCP connection to the hub either opens within a round trip or hangs until a firewall's
# timeout; 3 s is ample for the first and bounds the second.
HUB_PROBE_SECONDS = 3.0


def hub_unreachable() -> Optional[str]:
    """Why the Hugging Face hub (``$HF_ENDPOINT`` or huggingface.co) cannot be reached, or None:
    one short connection attempt, so an offline machine is told at once, not after
    huggingface_hub's retries (about 25 s)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    # Behind a proxy the hub is reached through it: the proxy is what must answer.
    proxy = getproxies().get(endpoint.scheme)
    if proxy and not proxy_bypass(endpoint.hostname or ""):
        endpoint = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    outcome: list[Optional[str]] = []

    def connect():
        try:
            with socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS):
                outcome.append(None)
        except OSError as e:
            outcome.append(f"{host}:{port}: {e.strerror or type(e).__name__}")
    # The name lookup is not covered by the socket's timeout (a silent DNS server can hold it
    # for many seconds): the attempt runs in a thread that is given up on after the timeout.
    attempt = threading.Thread(target=connect, daemon=True)
    attempt.start()
    attempt.join(HUB_PROBE_SECONDS)
    if not outcome:
        return f"{host}:{port}: no answer within {HUB_PROBE_SECONDS:g} s"
    return outcome[0]


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
    """Fetch the registered file ``name`` into ``model_dir`` and verify its sha256 (an interrupted
    download resumes: ``huggingface_hub`` keeps its partial file in ``model_dir/.cache``)."""
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
        fetched = Path(hf_hub_download(repo_id=KNOWN_FILES[name].repo, filename=_repo_path(name),
                                       local_dir=model_dir))
    except Exception as e:  # offline, DNS, HTTP errors, missing repository: all end here
        _remove_empty_locks(model_dir)
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{name}: download from {download_url(name)} failed ({detail}); "
                              f"download it by other means and put it in {model_dir}") from None
    if fetched.resolve() != target.resolve():
        os.replace(fetched, target)
    verify_file(target, name)
    return target


def _remove_empty_locks(model_dir: Path) -> None:
    """Drop the empty ``*.lock`` files huggingface_hub leaves in ``model_dir/.cache`` after a
    failed download (partial downloads stay: they let the next attempt resume)."""
    cache = model_dir / ".cache" / "huggingface"
    for lock in cache.rglob("*.lock") if cache.is_dir() else ():
        try:
            if lock.stat().st_size == 0:
                lock.unlink()
        except OSError:
            pass
