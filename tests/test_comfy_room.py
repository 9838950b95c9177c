"""Inside ComfyUI: we ask for the room our model files need on our device, not for every
byte (which unloaded every ComfyUI model on every run). How ComfyUI evicts our cached models:
tests/test_comfy_memory.py."""

from __future__ import annotations

import types

import torch

from seedvr2.memory.cache import ModelCache, ModelKey
from seedvr2.workflow import comfy_memory


def test_we_ask_comfyui_for_the_bytes_of_the_files_we_load(tmp_path):
    dit, vae = tmp_path / "dit.safetensors", tmp_path / "vae.safetensors"
    dit.write_bytes(b"d" * 3000)
    vae.write_bytes(b"v" * 500)
    cache = ModelCache()
    asked = []
    mm = types.SimpleNamespace(current_loaded_models=[],
                               free_memory=lambda required, device, keep_loaded=(): asked.append((required, device)),
                               get_torch_device=lambda: torch.device("cuda", 0),
                               soft_empty_cache=lambda: None)
    needed = comfy_memory.room_needed([dit, vae], cache, "cuda:1")
    comfy_memory.unload_comfy_models(mm, cache, needed, "cuda:1")
    assert asked == [(3500, torch.device("cuda", 1))]
    # A model our cache holds on that device adds nothing; on another device it still does.
    key = ModelKey("vae", str(vae.resolve()), 500, 1, "torch.float32", "cuda:1", ())
    cache.get_or_load(key, lambda: torch.nn.Linear(2, 2), keep=True)
    assert comfy_memory.room_needed([dit, vae], cache, "cuda:1") == 3000
    assert comfy_memory.room_needed([dit, vae], cache, "cuda:0") == 3500

