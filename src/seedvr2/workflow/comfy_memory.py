"""Our model cache as ComfyUI's memory management sees it, so ComfyUI can evict it.

ComfyUI frees memory by walking its list of loaded models,
``comfy.model_management.current_loaded_models``, and calling ``model_unload()`` on the
entries of the device it needs: ``unload_all_models()`` ("Unload models", ``POST /free``, after
an out-of-memory error) and ``free_memory()`` (whenever another node loads a model and needs
the room). Models kept with ``cache_model`` live in the library's cache
(:data:`seedvr2.memory.cache.MODEL_CACHE`), which ComfyUI does not know. So each cached model
gets one small :class:`CachedModelEntry` in that list, and its ``model_unload()`` drops the
model from our cache: ComfyUI evicts it like one of its own, in its own order.

No ComfyUI function is replaced or wrapped (ComfyUI restores some hooked functions after every
prompt, and wrapped functions break when other packs wrap them too). An entry provides what
``comfy.model_management`` of ComfyUI 0.3.75 reads from the entries of that list: ``device``,
``model`` (with ``.model`` for its log line), ``currently_used``, ``is_dead()``,
``real_model()``, ``model_memory()``, ``model_loaded_memory()``,
``model_offloaded_memory()``, ``model_memory_required()`` and ``model_unload()``. It is never
"currently used", so code that reloads the currently used models leaves it alone.

The entries follow the cache: :func:`sync` (called before and after each of our runs) adds one
for each newly cached model and removes those of models the cache no longer holds.

Test hook, never set by users: with ``SEEDVR2_TEST_CACHE_STATE=<path>``, the kinds of model in
the cache and in ComfyUI's list are written to that JSON file whenever they change here.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger("seedvr2")
CACHE_STATE_ENV = "SEEDVR2_TEST_CACHE_STATE"


class SeedVR2CachedModel:
    """Stands for the module in ComfyUI's log lines (``entry.model.model``'s class name)."""


class _CachedModelRef:
    """What ComfyUI finds as ``entry.model``: a model-patcher-like view of a cache key."""

    def __init__(self, key, cache):
        self.key = key
        self.cache = cache
        self.model = SeedVR2CachedModel()
        self.load_device = _device(key.device)
        self.parent = None

    def is_clone(self, other) -> bool:
        return False

    def model_size(self) -> int:
        return self.key.size

    def loaded_size(self) -> int:
        return self.resident_bytes()

    def resident_bytes(self) -> int:
        """Bytes of the cached model's tensors on its device now (0 once dropped; less than
        the file while parked on the offload device or partly swapped out)."""
        from ..memory.budget import bytes_on

        model = self.cache.peek(self.key)
        modules = model if isinstance(model, tuple) else (model,)
        return sum(bytes_on(m, self.load_device) for m in modules if isinstance(m, torch_module()))

    def current_loaded_device(self):
        return self.load_device

    def model_patches_models(self) -> list:
        return []


def _device(name: str):
    import torch

    return torch.device(name)


def torch_module():
    import torch

    return torch.nn.Module


class CachedModelEntry:
    """One cached model of ours in ``current_loaded_models``."""

    def __init__(self, key, cache):
        self.key = key
        self.cache = cache
        self.model = _CachedModelRef(key, cache)
        self.device = self.model.load_device
        self.currently_used = False
        self.unloaded = False  # ComfyUI removes it from its list once its unloading is done

    def __repr__(self) -> str:
        return f"<SeedVR2 cached {self.key.kind} {Path(self.key.path).name} on {self.device}>"

    def is_dead(self) -> bool:
        return False

    def real_model(self):
        return self.model.model

    # Sizes: what the model holds on its device now, so ComfyUI's choice of what to unload
    # frees what it expects (a parked or swapped-out model holds less than its file).
    def model_memory(self) -> int:
        return self.key.size

    def model_loaded_memory(self) -> int:
        return self.model.resident_bytes()

    def model_offloaded_memory(self) -> int:
        return max(self.key.size - self.model.resident_bytes(), 0)

    def model_memory_required(self, device) -> int:
        return 0 if device == self.device else self.key.size

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        """ComfyUI wants the memory back: drop the model from our cache (whole; we do not
        unload part of a model). Returns True: the entry is gone from ComfyUI's list."""
        try:
            if self.key in self.cache.keys():  # not a newer model of the same kind
                self.cache.drop(self.key.kind)
                log.info(f"SeedVR2: ComfyUI unloaded the cached {self.key.kind.upper()} "
                         f"({Path(self.key.path).name})")
        except Exception as e:  # never break ComfyUI's memory management
            log.warning(f"SeedVR2: could not release the cached {self.key.kind}: {e}")
        self.unloaded = True
        _write_state(self.cache)
        return True


def _entries(mm) -> list:
    return [e for e in _loaded_list(mm) if isinstance(e, CachedModelEntry)]


def _loaded_list(mm) -> list:
    models = getattr(mm, "current_loaded_models", None)
    return models if isinstance(models, list) else []


def sync(mm, cache) -> list:
    """Make ComfyUI's list hold one entry per model in ``cache``; returns our entries."""
    models = getattr(mm, "current_loaded_models", None)
    if not isinstance(models, list):
        return []  # a ComfyUI without that list: it cannot evict our models, nothing to do
    cached = set(cache.keys())
    for entry in _entries(mm):
        if entry.key not in cached or entry.cache is not cache:
            models.remove(entry)
    present = {e.key for e in _entries(mm)}
    for key in cache.keys():
        if key not in present:
            try:
                models.append(CachedModelEntry(key, cache))
            except (RuntimeError, ValueError) as e:  # a device torch does not know here
                log.warning(f"SeedVR2: the cached {key.kind} is not known to ComfyUI's memory "
                            f"management: {e}")
    _write_state(cache)
    return _entries(mm)


def room_needed(model_files, cache, device: str) -> int:
    """Bytes our next run adds on ``device`` before any activation: the model files it will
    load there (those our cache already holds on that device cost nothing more)."""
    cached = {(k.path, k.device) for k in cache.keys()}
    total = 0
    for path in model_files:
        resolved = str(Path(path).resolve())
        if (resolved, str(device)) not in cached and Path(path).is_file():
            total += Path(path).stat().st_size
    return total


def unload_comfy_models(mm, cache, required_bytes: int, device=None) -> None:
    """Ask ComfyUI for ``required_bytes`` free on ``device`` (default: its torch device),
    keeping our cached models. ComfyUI unloads its models, least recently used first, only
    until that much is free (plus its own reserve), not every model it holds."""
    ours = sync(mm, cache)
    device = mm.get_torch_device() if device is None else _device(str(device))
    mm.free_memory(int(required_bytes), device, keep_loaded=ours)
    mm.soft_empty_cache()


def _write_state(cache) -> None:
    target: Optional[str] = os.environ.get(CACHE_STATE_ENV)
    if not target:
        return
    mm = sys.modules.get("comfy.model_management")
    state = {"cached": sorted(k.kind for k in cache.keys()),
             "registered": sorted(e.key.kind for e in _entries(mm) if not e.unloaded)}
    tmp = Path(target + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(target)
