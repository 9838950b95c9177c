"""Our model cache inside ComfyUI's memory management: each model kept with ``cache_model``
(:data:`seedvr2.memory.cache.MODEL_CACHE`) is handed to ComfyUI as a subclass of its
``ModelPatcher`` (wrapping a weightless stand-in) in its own ``LoadedModel`` entry, so ComfyUI
evicts it like its own models. Relied on (0.3.75 and the current release): ``comfy.model_patcher.
ModelPatcher(model, load_device, offload_device, size)``, ``comfy.model_management.LoadedModel(
patcher)`` and its ``model_load()``, ``free_memory(memory_required, device, keep_loaded)``,
``get_torch_device()``, ``soft_empty_cache()``, ``current_loaded_models``. What the subclass
changes and why: docs/comfyui.md ("Loading, the model cache and ComfyUI's memory"). The tests
follow the cache and ComfyUI's list through a file (:mod:`seedvr2.faults`)."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

from ..faults import Faults

log = logging.getLogger("seedvr2")
# What our patcher class overrides, each a method ComfyUI's LoadedModel calls on a patcher.
OVERRIDDEN = ("partially_load", "partially_unload", "model_size", "loaded_size", "detach")


@functools.cache
def patcher_class() -> type:
    """``SeedVR2CachedModelPatcher`` on ComfyUI's ModelPatcher (imported here: not at import)."""
    import torch
    from comfy.model_patcher import ModelPatcher

    from ..memory.budget import bytes_on

    class SeedVR2CachedModel(torch.nn.Module):
        """A weightless stand-in for one cached model, so the weights can die with our cache
        entry while the module ComfyUI's finalizer watches outlives its unloading loop."""

        def __init__(self):
            super().__init__()
            self.keepalive: list = []

    class SeedVR2CachedModelPatcher(ModelPatcher):
        """One model of our cache, as ComfyUI's memory management sees it."""

        def __init__(self, key, cache):
            device = torch.device(key.device)
            # offload_device = load_device: ComfyUI's own paths that move weights "to the
            # offload device" leave ours where they are; what frees them is detach().
            super().__init__(SeedVR2CachedModel(), device, device, size=1)
            self.key, self.cache = key, cache

        def model_size(self) -> int:
            return bytes_on(_module_of(self.cache.peek(self.key)), self.load_device)

        def loaded_size(self) -> int:
            return self.model_size()

        # **kwargs: a later release passing one more option still reaches these.
        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False,
                           **kwargs) -> int:
            return 0

        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False,
                             **kwargs) -> int:
            return 0

        def detach(self, unpatch_all=True, **kwargs):
            # Also reached from ModelPatcher.__del__ once our cache dropped us: nothing to release.
            if self.cache.attached(self.key) is not self:
                return self.model
            # The stand-in lives on (a cycle, weightless, collected later) past ComfyUI's
            # loop; our cache entry, and so the weights, go now.
            self.model.keepalive.append(self.model)
            if self.cache.release(self.key):
                log.info(f"SeedVR2: ComfyUI unloaded the cached {self.key.kind.upper()} "
                         f"({Path(self.key.path).name})")
                _write_state(self.cache)
            return self.model

    return SeedVR2CachedModelPatcher


def _module_of(cached):
    import torch

    candidates = cached if isinstance(cached, tuple) else (cached,)  # (model, placement)
    return next((m for m in candidates if isinstance(m, torch.nn.Module)), None)


def our_entries(mm, cache) -> list:
    """ComfyUI's entries for the models of ``cache`` (none when ``mm`` has no list)."""
    ours = {id(cache.attached(k)) for k in cache.keys() if cache.attached(k) is not None}
    loaded = getattr(mm, "current_loaded_models", None)
    return [e for e in loaded if id(e.model) in ours] if isinstance(loaded, list) else []


def sync(mm, cache) -> list:
    """Hand ComfyUI each cached model it lacks (evicted ones took their patchers); our entries."""
    fresh = []
    for key in cache.keys():
        if cache.attached(key) is not None or _module_of(cache.peek(key)) is None:
            continue
        try:
            patcher = patcher_class()(key, cache)
        except (RuntimeError, ValueError) as e:  # a device torch does not know here
            log.warning(f"SeedVR2: the cached {key.kind} is not known to ComfyUI's memory "
                        f"management: {e}")
            continue
        cache.attach(key, patcher)
        fresh.append(patcher)
    _register(mm, fresh)
    entries = our_entries(mm, cache)
    for entry in entries:
        entry.currently_used = False  # between our runs; the nodes running now never use it
    _write_state(cache)
    return entries


def _register(mm, patchers) -> None:
    """Enter ``patchers`` in ComfyUI's list as ``load_models_gpu`` does, minus its ``free_memory``
    call: ours are where they run, and it would claim pinned host memory ours never take."""
    for patcher in patchers:
        entry = mm.LoadedModel(patcher)
        entry.model_load()
        mm.current_loaded_models.insert(0, entry)


def room_needed(model_files, cache, device: str) -> int:
    """Bytes the next run adds on ``device`` before activations: model files not cached there."""
    cached = {(k.path, k.device) for k in cache.keys()}
    return sum(Path(path).stat().st_size for path in model_files
               if (str(Path(path).resolve()), str(device)) not in cached and Path(path).is_file())


def unload_comfy_models(mm, cache, required_bytes: int, device=None) -> None:
    """Ask ComfyUI for ``required_bytes`` free on ``device`` (default: its own), keeping ours: it
    unloads its models, least recently used first, until that much (plus its reserve) is free."""
    import torch

    ours = sync(mm, cache)
    device = mm.get_torch_device() if device is None else torch.device(str(device))
    mm.free_memory(int(required_bytes), device, keep_loaded=ours)
    mm.soft_empty_cache()


def _write_state(cache) -> None:
    faults = Faults.from_environment()
    if not faults.cache_state:
        return
    mm = sys.modules.get("comfy.model_management")
    registered = [e.model.key.kind for e in our_entries(mm, cache)]
    faults.record_cache_state({"cached": sorted(k.kind for k in cache.keys()),
                               "registered": sorted(registered)})
