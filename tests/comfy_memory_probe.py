"""Run by tests/test_comfy_memory.py with the test ComfyUI's Python: our cached models handed to
ComfyUI's real memory management (comfy.model_management and comfy.model_patcher of the
installed release, --cpu), driven through its own functions. Prints one JSON report.

    python comfy_memory_probe.py COMFYUI_DIR
"""

from __future__ import annotations

import gc
import inspect
import json
import sys
import weakref

sys.path.insert(0, sys.argv[1])
from comfy.cli_args import args  # noqa: E402

args.cpu = True
import comfy.model_management as mm  # noqa: E402
import comfy.model_patcher as mp  # noqa: E402
import torch  # noqa: E402

from seedvr2.memory.cache import ModelCache, ModelKey  # noqa: E402
from seedvr2.workflow import comfy_memory  # noqa: E402

# What the current ComfyUI release reads on every entry of current_loaded_models or on its
# patcher (free_memory, models_for_pin_eviction, unload_model_and_clones, load_models_gpu):
# taken by those functions from the ModelPatcher base class, which ours must not shadow.
CURRENT_RELEASE_READS = ("is_dynamic", "clone_base_uuid", "get_nested_additional_models",
                         "model_patches_models", "is_clone", "model_dtype", "model_patches_to",
                         "current_loaded_device", "lowvram_patch_counter", "parent",
                         "load_device", "offload_device")

report: dict = {}
cache = ModelCache()
device = mm.get_torch_device()


def key(kind, name):
    return ModelKey(kind, f"/m/{name}.safetensors", 1, 1, "torch.float32", str(device), ())


def kinds():
    return {"cached": sorted(k.kind for k in cache.keys()),
            "comfy": sorted(type(e.model).__name__ if e.model is not None else "dead"
                            for e in mm.current_loaded_models)}


# A stand-in of the current release's pin accounting in load_models_gpu (0.3.75 has none):
# model_memory() of every model it loads that is not dynamic is claimed as pinned host memory
# (free_memory(..., pins_required=) then tears down or unregisters other models' pins).
pin_claims: list = []
installed_load_models_gpu = mm.load_models_gpu


def load_models_gpu_with_pin_accounting(models, *args, **kwargs):
    pin_claims.append(sum(mm.LoadedModel(m).model_memory() for m in models
                          if not getattr(m, "is_dynamic", lambda: False)()))
    return installed_load_models_gpu(models, *args, **kwargs)


mm.load_models_gpu = load_models_gpu_with_pin_accounting

dit, vae = key("dit", "dit"), key("vae", "vae")
cache.get_or_load(dit, lambda: (torch.nn.Linear(64, 64), object()), keep=True)  # as the DiT
cache.get_or_load(vae, lambda: (torch.nn.Linear(8, 8), object()), keep=True)
entries = comfy_memory.sync(mm, cache)
report["entry_types"] = sorted({type(e).__name__ for e in entries})
report["patcher_is_comfy"] = all(isinstance(e.model, mp.ModelPatcher) for e in entries)
report["after_sync"] = kinds()
report["sync_again_adds_nothing"] = comfy_memory.sync(mm, cache) == entries
report["pins_claimed_by_sync"] = sum(pin_claims)

# Every read the current release makes, on the real entries.
cls = comfy_memory.patcher_class()
report["shadowed"] = sorted(set(vars(cls)) & set(CURRENT_RELEASE_READS))
report["installed_base_has"] = sorted(n for n in CURRENT_RELEASE_READS
                                      if hasattr(mp.ModelPatcher, n) or hasattr(entries[0].model, n))
def accepts_base_call(name):
    """Ours takes every parameter the installed base method takes, in the same places."""
    ours = list(inspect.signature(getattr(cls, name)).parameters)
    base = list(inspect.signature(getattr(mp.ModelPatcher, name)).parameters)
    return ours[:len(base)] == base


report["overrides_match_base"] = {name: accepts_base_call(name)
                                  for name in comfy_memory.OVERRIDDEN}
reads = []
for e in mm.current_loaded_models:
    p = e.model
    reads.append({
        "device": str(e.device), "dead": e.is_dead(), "currently_used": e.currently_used,
        "memory": e.model_memory(), "loaded": e.model_loaded_memory(),
        "offloaded": e.model_offloaded_memory(), "required": e.model_memory_required(device),
        "class": p.model.__class__.__name__, "nested": p.get_nested_additional_models(),
        "patches_models": p.model_patches_models(), "clone_of_other": any(
            p.is_clone(o.model) for o in mm.current_loaded_models if o is not e),
        "is_dynamic": p.is_dynamic() if hasattr(p, "is_dynamic") else None,
        "partially_unload": p.partially_unload(p.offload_device, 1)})
report["reads"] = reads

# A second model (ComfyUI's own kind of patcher) loads: ours stay, and stay in the list.
other = mp.ModelPatcher(torch.nn.Linear(4, 4), device, device)
mm.load_models_gpu([other])
report["pins_claimed_by_other"] = pin_claims[-1]
report["after_second_load"] = kinds()
# free_memory with room to spare unloads nothing...
mm.free_memory(1, device)
report["after_free_memory_with_room"] = kinds()
# ...and when the room is needed, ComfyUI unloads ours like its own (keeping the other).
keep = [e for e in mm.current_loaded_models if e.model is other]
dit_weights = weakref.ref(cache.peek(dit)[0])
mm.free_memory(1e30, device, keep_loaded=keep)
report["after_free_memory_all_but_other"] = kinds()
report["weights_freed_at_once"] = dit_weights() is None  # no garbage collection needed

# Our cache evicting a model itself: ComfyUI's entry goes with it (its finalizer).
cache.get_or_load(dit, lambda: (torch.nn.Linear(64, 64), object()), keep=True)
comfy_memory.sync(mm, cache)
report["recached"] = kinds()
cache.get_or_load(key("dit", "dit_other"), lambda: (torch.nn.Linear(2, 2), object()), keep=False)
gc.collect()
report["after_own_eviction"] = kinds()

# "Unload models" / POST /free.
cache.get_or_load(vae, lambda: (torch.nn.Linear(8, 8), object()), keep=True)
comfy_memory.sync(mm, cache)
mm.unload_all_models()
gc.collect()
report["after_unload_all"] = kinds()
print(json.dumps(report))
