"""The model cache: the library's one piece of global mutable state, on purpose.

ComfyUI runs workflow after workflow in one process, the CLI folder after folder: reloading a 7B
model each time would waste minutes. ``MODEL_CACHE`` keys loaded models by everything that shaped
them (file identity, format, precision, device, BlockSwap and compile settings), so a changed
setting reloads exactly the model it concerns. ``clear()`` frees everything. A loaded module
passed in (the CLI's once-loaded models, a library caller's own) keeps the placement made for
it under the same settings (``placement_of``), weakly: it goes with the module."""

from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class ModelKey:
    kind: str  # "dit" or "vae"
    path: str
    size: int
    mtime_ns: int
    dtype: str
    device: str
    settings: tuple  # BlockSwap / compile / attention settings that change the loaded module

    @classmethod
    def for_file(cls, kind: str, path: Path, dtype: torch.dtype, device: torch.device,
                 settings: tuple) -> "ModelKey":
        stat = Path(path).stat()
        return cls(kind, str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, str(dtype),
                   str(device), settings)


class ModelCache:
    def __init__(self):
        self._models: dict[ModelKey, object] = {}
        # One object per cached model that lives exactly as long as the model stays cached
        # (inside ComfyUI: the ModelPatcher through which ComfyUI can evict it).
        self._attached: dict[ModelKey, object] = {}
        # A loaded module passed in (not a file): the settings its placement was made under and
        # the placement, both weakly (a placement holds its module; BlockSwap lives as long as
        # its hooks on the module). A module carries one placement: two would each keep a host
        # copy, and BlockSwap's hooks would stack.
        self._placed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get_or_load(self, key: ModelKey, load: Callable[[], object], keep: bool):
        """The cached model for ``key``, else ``load()`` (cached when ``keep``); a cached model
        of the same kind with other settings is evicted first (it would only hold memory)."""
        with self._lock:
            if key in self._models:
                return self._models[key]
            evicted = self._evict(lambda k: k.kind == key.kind)
        if evicted:
            evicted.clear()
            _free()  # the old model's device memory and pinned host copy go before the new load
        model = load()
        if keep:
            with self._lock:
                self._models[key] = model
        return model

    def placement_of(self, module: torch.nn.Module, settings: tuple, place: Callable[[], object]):
        """The placement of a caller's loaded ``module`` under ``settings``: the one made
        before under the same settings, else ``place()``'s (the earlier one undone first)."""
        with self._lock:
            settings_before, placed = self._placed.get(module, (None, lambda: None))
        before = placed()
        if before is not None and settings_before == settings:
            return before
        if before is not None:
            before.leave()
        placement = place()
        with self._lock:
            if placement is None:  # none to keep: placed again next time (a move at most)
                self._placed.pop(module, None)
            else:
                self._placed[module] = (settings, weakref.ref(placement))
        return placement

    def peek(self, key: ModelKey):
        """The cached model for ``key`` or None, never loading."""
        with self._lock:
            return self._models.get(key)

    def attach(self, key: ModelKey, companion) -> None:
        """Keep ``companion`` while ``key``'s model is cached; it goes when the model goes."""
        with self._lock:
            if key in self._models:
                self._attached[key] = companion

    def attached(self, key: ModelKey):
        with self._lock:
            return self._attached.get(key)

    def release(self, key: ModelKey) -> bool:
        """Forget ``key``'s model without collecting garbage (for a caller that is inside a
        loop over objects a collection may finalize); True when it was cached."""
        with self._lock:
            gone = self._evict(lambda k: k == key)
        return bool(gone)  # dropped here, out of the lock (a companion's __del__ may use us)

    def _evict(self, match) -> list:
        """Remove the matching entries; returns them, to drop out of the lock."""
        gone = []
        for k in [k for k in self._models if match(k)]:
            gone.append((self._models.pop(k), self._attached.pop(k, None)))
        return gone

    def drop(self, kind: str | None = None):
        with self._lock:
            gone = self._evict(lambda k: kind is None or k.kind == kind)
        gone.clear()
        _free()

    def clear(self):
        self.drop()

    def __len__(self):
        return len(self._models)

    def keys(self):
        return list(self._models)


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


MODEL_CACHE = ModelCache()
