"""What a job is made of, by content: digests of model files and input media.

Two processes (ranks of one job, or a killed run and its re-run) must agree that they use the
same weights and the same input. Names and sizes do not say that: a copy of a checkpoint with
one bias changed has both. So files are compared by a full SHA-256 of their content. Hashing
a 16 GB checkpoint takes seconds, so each digest is remembered in a small cache keyed by the
file's real path, size, modification time and inode: a file rewritten in place gets a new
mtime and is hashed again.

The cache is ``$SEEDVR2_CACHE_DIR/file-digests.json`` (default ``~/.cache/seedvr2``, or under
``$XDG_CACHE_HOME``); a cache that cannot be read or written only costs time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from ..loading.registry import sha256_of

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


def model_digest(spec) -> str:
    """A model argument by content: a file's digest, else (a registered name not on this
    machine yet, a loaded module) its text."""
    path = Path(str(spec)) if spec is not None else None
    return file_digest(path) if path is not None and path.is_file() else f"name:{spec}"


def source_digest(reader) -> str:
    """The input of a file job by content: the video or image file, or every file of an
    image sequence in order (names included: the order is the frames' order)."""
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
