"""Our cached models inside ComfyUI's real memory management (the installed test ComfyUI
0.3.75, --cpu): handed over as ComfyUI's own ModelPatcher / LoadedModel, so every read
ComfyUI makes on its list works, and evicted by ComfyUI's own functions.

tests/comfy_memory_probe.py runs in the test ComfyUI's Python (its comfy package needs its
requirements) and reports; the assertions are here."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import REPO
from test_comfyui_server import _install


def test_comfyui_evicts_our_cached_models_through_its_own_classes():
    comfy_dir, python = _install()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(python), str(REPO / "tests" / "comfy_memory_probe.py"),
                          str(comfy_dir)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    ours, both = "SeedVR2CachedModelPatcher", ["dit", "vae"]
    # ComfyUI's own entry class around its own patcher class, once per model.
    assert report["entry_types"] == ["LoadedModel"] and report["patcher_is_comfy"]
    assert report["after_sync"] == {"cached": both, "comfy": [ours, ours]}
    assert report["sync_again_adds_nothing"]
    # Ours claim none of ComfyUI's pinned host memory (a stand-in of the current release's
    # accounting in load_models_gpu: model_memory() of each non-dynamic model it loads), while
    # a model ComfyUI loads itself is claimed at its size (Linear(4, 4), fp32).
    assert report["pins_claimed_by_sync"] == 0
    assert report["pins_claimed_by_other"] == (4 * 4 + 4) * 4
    # What the current release reads on each entry (is_dynamic, clone_base_uuid, ...) comes
    # from ComfyUI's base class: we shadow none of it, and override only methods the
    # installed release has, with its parameters.
    assert report["shadowed"] == []
    assert {"get_nested_additional_models", "model_patches_models", "is_clone",
            "current_loaded_device", "parent"} <= set(report["installed_base_has"])
    assert all(report["overrides_match_base"].values()), report["overrides_match_base"]
    # Sizes: the bytes each model holds on its device (DiT Linear(64, 64), VAE Linear(8, 8),
    # fp32), all loaded, nothing for ComfyUI to make room for; never partly unloaded.
    vae_bytes, dit_bytes = (8 * 8 + 8) * 4, (64 * 64 + 64) * 4
    # (load_models_gpu takes its models as a set: any order)
    assert sorted((r["memory"], r["loaded"], r["offloaded"], r["required"])
                  for r in report["reads"]) == [(vae_bytes, vae_bytes, 0, 0), (dit_bytes, dit_bytes, 0, 0)]
    assert all(not r["dead"] and not r["currently_used"] and r["nested"] == []
               and r["patches_models"] == [] and not r["clone_of_other"]
               and r["partially_unload"] == 0 and r["class"] == "SeedVR2CachedModel"
               for r in report["reads"])
    # A second model's load and free_memory with room to spare keep ours...
    assert report["after_second_load"] == {"cached": both,
                                           "comfy": ["ModelPatcher", ours, ours]}
    assert report["after_free_memory_with_room"] == report["after_second_load"]
    # ...free_memory needing the room unloads them (their weights at once), not the kept one.
    assert report["after_free_memory_all_but_other"] == {"cached": [], "comfy": ["ModelPatcher"]}
    assert report["weights_freed_at_once"]
    # Our cache evicting a model itself takes ComfyUI's entry with it.
    assert report["recached"] == {"cached": ["dit"], "comfy": ["ModelPatcher", ours]}
    assert report["after_own_eviction"] == {"cached": [], "comfy": ["ModelPatcher"]}
    # "Unload models".
    assert report["after_unload_all"] == {"cached": [], "comfy": []}
