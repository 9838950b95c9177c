"""What a job is made of, by content: digests of model files and input media.

Ranks of one job, or a killed run and its re-run, must agree that they use the same weights
and input; names and sizes do not say that (a checkpoint with one bias changed has both), so
files are compared by a full SHA-256. Hashing 16 GB takes seconds, so each digest is cached
by the file's real path, size, mtime and inode in ``$SEEDVR2_CACHE_DIR/file-digests.json``
(default ``~/.cache/seedvr2``, or under ``$XDG_CACHE_HOME``); a cache that cannot be read or
written only costs time."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..loading.registry import DEFAULT_DIT, DEFAULT_VAE, resolve_model_files, sha256_of
from ..options import NOT_SHAPING_OUTPUT, Options

CACHE_ENV = "SEEDVR2_CACHE_DIR"
_MAX_ENTRIES = 4096  # one line per file ever hashed; old ones go first


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "seedvr2"


def _key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _read_cache(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(file: Path, entries: dict):
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        keep = dict(list(entries.items())[-_MAX_ENTRIES:])
        # Written whole and renamed: ranks hashing at once never read half a file.
        fd, temp = tempfile.mkstemp(dir=file.parent, prefix=".file-digests-")
        with os.fdopen(fd, "w") as f:
            json.dump(keep, f)
        os.replace(temp, file)
    except OSError:
        pass


def file_digest(path) -> str:
    """SHA-256 (hex) of a file's content, cached by path, size, mtime and inode."""
    path = Path(path)
    key = _key(path)
    cache = cache_dir() / "file-digests.json"
    entries = _read_cache(cache)
    if key in entries:
        return entries[key]
    digest = sha256_of(path)
    entries = _read_cache(cache)  # another process may have added entries meanwhile
    entries.pop(key, None)
    entries[key] = digest
    _write_cache(cache, entries)
    return digest


@dataclass(frozen=True)
class ModelRef:
    """A model as the caller gave it (None, a registered name, a path, or a loaded module);
    once resolved (:func:`model_refs`), the module or the weight file's ``Path``."""

    kind: str  # "dit" or "vae"
    model: Any

    @property
    def loaded(self) -> bool:
        return isinstance(self.model, torch.nn.Module)

    @property
    def file(self) -> Path | None:
        """The weight file: the one given, or the one a loaded module came from."""
        return getattr(self.model, "weights_file", None) if self.loaded else self.model

    def digest(self) -> str:
        """The weights by content: the file's digest, else the loaded module's tensors."""
        return file_digest(self.file) if self.file else _module_digest(self.model)


def model_refs(dit, vae, model_dir: Path) -> tuple[ModelRef, ModelRef]:
    """Both models resolved before either loads, so one error names every missing file."""
    specs = {"dit": dit, "vae": vae}
    wanted = [(spec or default, kind) for (kind, spec), default in
              zip(specs.items(), (DEFAULT_DIT, DEFAULT_VAE))
              if not isinstance(spec, torch.nn.Module)]
    paths = iter(resolve_model_files(wanted, model_dir, download_missing=True))
    return tuple(ModelRef(kind, spec if isinstance(spec, torch.nn.Module) else next(paths))
                 for kind, spec in specs.items())


def _module_digest(module: torch.nn.Module) -> str:
    """A loaded model's weights by content (the CLI passes its once-loaded models)."""
    whole = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        whole.update(name.encode())
        whole.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                     if tensor.numel() else b"")
    return whole.hexdigest()


def job_identity(opts: Options, source: str, models: tuple[ModelRef, ModelRef]) -> dict:
    """A job's one fingerprint, what its frames depend on: the options that shape the output (not
    :data:`~seedvr2.options.NOT_SHAPING_OUTPUT`), the input (``source``: its digest) and the weights
    by content. Ranks agree on it (:func:`identity_digest`); the resume journal records it."""
    text = Path(str(opts.text_embeddings))
    # Tuples (the resolved scene_cuts) as lists: the resume journal compares a re-read JSON.
    return {"options": {k: list(v) if isinstance(v, tuple) else v
                        for k, v in sorted(opts.values.items()) if k not in NOT_SHAPING_OUTPUT},
            "source": source, **{ref.kind: ref.digest() for ref in models},
            "text": file_digest(text) if text.is_file() else str(opts.text_embeddings)}


def identity_digest(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def source_digest(reader) -> str:
    """The input of a file job by content: its file, or every file of an image sequence in
    order (names included: the order is the frames')."""
    files = getattr(reader, "files", None)
    if files is None:
        return file_digest(reader.info.path)
    return files_digest(files, file_digest)


def files_digest(files: Iterable, digest_of: Callable[[Path], str]) -> str:
    """One SHA-256 of several files in order: each one's name and ``digest_of`` it."""
    whole = hashlib.sha256()
    for f in files:
        whole.update(f"{Path(f).name}\0{digest_of(f)}\n".encode())
    return whole.hexdigest()
