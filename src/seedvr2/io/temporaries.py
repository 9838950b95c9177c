"""Hidden temporaries next to an output: how they are named, held and cleaned up.

The one place that names them (``.NAME.partial-TOKEN`` for folders and images,
``.STEM.partial-TOKEN.EXT`` for videos), so the writer that makes them and whoever cleans up after a
crash look for the same names. A live writer holds an exclusive ``flock`` on its temporary, which
the kernel drops however the process ends: one nobody can lock is in use, one that can be locked is
stale (docs/multi-gpu.md#temporary-files)."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
from pathlib import Path

PARTIAL = ".partial-"
RESUME_SUFFIX = ".seedvr2-resume"
RESUME_JOURNAL = "journal.json"  # a resume folder without one keeps nothing worth resuming


def temporary_path(final: Path, *, keep_suffix: bool) -> Path:
    """A fresh temporary name for ``final`` (``keep_suffix``: end with its extension)."""
    token = secrets.token_hex(4)
    if keep_suffix and final.suffix:
        return final.parent / f".{final.stem}{PARTIAL}{token}{final.suffix}"
    return final.parent / f".{final.name}{PARTIAL}{token}"


def resume_folder(final) -> Path:
    """The folder where a resumable job keeps the closed pieces of ``final``."""
    final = Path(str(final).rstrip("/\\") or ".")
    return final.parent / f".{final.name}{RESUME_SUFFIX}"


def temporaries_of(final) -> list[Path]:
    """Every temporary (of any writer, live or stale) that :func:`temporary_path` can have
    made for ``final``."""
    final = Path(str(final).rstrip("/\\") or ".")
    folder = final.parent
    if not folder.is_dir():
        return []
    found = set(folder.glob(f".{final.name}{PARTIAL}*"))
    if final.suffix:
        found.update(p for p in folder.glob(f".{final.stem}{PARTIAL}*{final.suffix}")
                     if len(p.name) == len(f".{final.stem}{PARTIAL}") + 8 + len(final.suffix))
    return sorted(found)


class Hold:
    """An exclusive lock on a temporary for as long as its writer lives."""

    def __init__(self, path: Path):
        flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
        self._fd = os.open(path, flags)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise

    def release(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def holds(self, path: Path) -> bool:
        """Whether ``path`` still names the locked file (not one removed and made again)."""
        try:
            now = os.stat(path)
        except OSError:
            return False
        held = os.fstat(self._fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def hold(path: Path) -> Hold | None:
    """Lock ``path`` as in use; ``None`` where the filesystem has no locks (then nothing is
    ever taken for stale: an unlocked temporary would look abandoned)."""
    try:
        return Hold(path)
    except OSError:
        return None


def lock_folder(path: Path) -> Hold | None:
    """Make the folder ``path`` if needed and lock it for this process's lifetime (or until
    released): raises :class:`BlockingIOError` while another holds it; ``None`` without locks."""
    for _ in range(3):
        path.mkdir(exist_ok=True)
        try:
            held = Hold(path)
        except (BlockingIOError, FileNotFoundError) as e:
            if isinstance(e, BlockingIOError):
                raise
            continue  # removed as stale between mkdir and lock: make it again
        except OSError:
            return None
        if held.holds(path):
            return held
        held.release()  # its holder removed it just before we locked it: lock the new one
    raise BlockingIOError(f"{path} is removed and made again by another process")


def abandoned(path: Path) -> bool:
    """Whether ``path`` was locked by a process that is gone: nobody holds it now. False
    where the filesystem has no locks (then nothing is taken for abandoned)."""
    try:
        probe = Hold(path)
    except OSError:  # a live writer holds it (BlockingIOError), no locks here, or gone
        return False
    probe.release()
    return True


def remove_stale_temporaries(final) -> list[Path]:
    """Remove (and return) ``final``'s temporaries no live process holds, and its resume folder when
    no live job holds it and it keeps nothing (no journal: killed before a piece closed)."""
    removed = []
    resume = resume_folder(final)
    if resume.is_dir() and not (resume / RESUME_JOURNAL).exists() and abandoned(resume):
        shutil.rmtree(resume, ignore_errors=True)
        removed.append(resume)
    for temp in temporaries_of(final):
        if not abandoned(temp):
            continue
        if temp.is_dir() and not temp.is_symlink():
            shutil.rmtree(temp, ignore_errors=True)
        else:
            temp.unlink(missing_ok=True)
        removed.append(temp)
    return removed
