"""The models a job runs, loaded and placed as the options say: through the model cache,
each on its device or waiting on its offload device (a DiT with BlockSwap when asked),
compiled, with the VAE's kernel paths and the compute precision set for this run."""

from __future__ import annotations

from pathlib import Path

import torch

from ..loading import load_dit, load_vae
from ..loading.packed_layers import set_compute_precision
from ..loading.registry import default_model_dir
from ..loading.text import load_text_embeddings
from ..memory import MODEL_CACHE, ModelKey
from ..memory.blockswap import BlockSwap
from ..memory import budget as mem
from ..memory.compile import CompileSettings, apply_compile
from ..memory.fit import ModelDevices
from ..memory.placement import OffloadedModel, default_pin, host_copy_bytes
from ..models.vae_paths import INT8_CACHE_BYTES, choose_paths
from ..options import OptionError, Options, option_ref
from .identity import ModelRef, model_refs
from .runner import Models


def _settings_of(opts: Options, kind: str) -> tuple:
    """The options that shape a loaded model (its cache key besides file, dtype and device)."""
    compiled = CompileSettings.from_options(opts)
    if kind == "vae":
        return (compiled, opts.vae_offload_device)
    return (compiled, opts.blocks_to_swap, opts.swap_io_components, opts.dit_offload_device,
            opts.attention_backend)


def _placed_as(opts: Options, kind: str, dtype, device, offload) -> tuple:
    """What a model's placement depends on: a module placed under these is reused as placed."""
    return (str(dtype), str(device), str(offload), _settings_of(opts, kind))


def _check_host_copy(model, offload, setting: str):
    """The offloaded model's host copy must fit the host RAM (its own tensors there count as
    available: the copy replaces them)."""
    if offload is not None and offload.type == "cpu":
        available = mem.host_available()
        if available is not None:
            available += mem.bytes_on(model, offload)
        mem.check_host_copy(host_copy_bytes(model), available, setting)


def _placement(model, device, offload, setting: str):
    """An offloaded model waits in one persistent host copy (pinned on CUDA) between its
    phases; without an offload device it simply stays on its device."""
    if offload is None:
        return None
    _check_host_copy(model, offload, setting)
    return OffloadedModel(model, device, offload, default_pin(device, offload))


def _swapping(kind: str, opts: Options, offload) -> bool:
    swapping = kind == "dit" and (opts.blocks_to_swap > 0 or opts.swap_io_components)
    if swapping and offload is None:
        raise OptionError(f"{option_ref('blocks_to_swap')}/{option_ref('swap_io_components')} need "
                          f"an offload device for the swapped weights: set "
                          f"{option_ref('dit_offload_device', 'cpu')} (or another device)")
    return swapping


def _place(model, kind: str, opts: Options, device, offload):
    """A model on its offload device (else its device) placed as the options say: a DiT with
    BlockSwap when asked (on CUDA), an offloaded model in its host copy, else none."""
    if kind == "dit":
        model.set_attention_backend(opts.attention_backend)
    placement = None
    if _swapping(kind, opts, offload):
        _check_host_copy(model, offload, "dit_offload_device")
        placement = BlockSwap(model, opts.blocks_to_swap, opts.swap_io_components, device, offload)
        # Parked until its phase, as an offloaded model waits: BlockSwap brings the resident
        # weights to the GPU at once, where they sat through the first encode (3B: 4.25 GiB).
        placement.park()
    if placement is None or not placement.active:  # no CUDA: plain offloading
        placement = _placement(model, device, offload, f"{kind}_offload_device")
    return placement


def _load_file(ref: ModelRef, opts: Options, dtype, device, offload):
    """A model file loaded, placed and compiled."""
    _swapping(ref.kind, opts, offload)  # (refused before a long load)
    # An offloaded model loads on its offload device; only what runs reaches the GPU.
    model = (load_dit if ref.kind == "dit" else load_vae)(
        ref.model, dtype, offload if offload is not None else device)
    placement = _place(model, ref.kind, opts, device, offload)
    # The same module passed back in (the CLI's once-loaded models) keeps this placement.
    MODEL_CACHE.placement_of(model, _placed_as(opts, ref.kind, dtype, device, offload),
                             lambda: placement)
    apply_compile(*((model, None) if ref.kind == "dit" else (None, model)),
                  CompileSettings.from_options(opts))
    return model, placement


def load_models(dit=None, vae=None, *, opts: Options, model_dir=None) -> Models:
    """DiT, VAE and text embedding placed and prepared as the options say (cached if asked)."""
    where = ModelDevices.of(opts)
    dtype, dit_device, vae_device = where.dtype, where.dit, where.vae
    dit_offload, vae_offload = where.dit_offload, where.vae_offload
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    dit_ref, vae_ref = model_refs(dit, vae, model_dir)
    dit, dit_placement = _ready_model(dit_ref, opts, dtype, dit_device, dit_offload)
    vae, vae_placement = _ready_model(vae_ref, opts, dtype, vae_device, vae_offload)
    # Per run, not per load: how the VAE runs, not what it holds (cached or given VAEs too).
    vae.set_conv_settings(cudnn_benchmark=opts.vae_cudnn_benchmark, paths=choose_paths(
        vae_device, vae.dtype, channels_last=opts.vae_channels_last,
        fp16_accumulation=opts.vae_fp16_accumulation,
        int8_cache_bytes=None if opts.vae_int8_cache == "off" else INT8_CACHE_BYTES,
        cache_offload=opts.vae_int8_cache == "host"))
    for model in (dit, vae):
        set_compute_precision(model, opts.compute_precision)
    embedded = getattr(dit, "embedded_text_embeddings", None) or {}
    text = load_text_embeddings(opts.text_embeddings, dit.config.txt_in_dim, model_dir,
                                embedded=embedded.get("pos"))
    return Models(dit, vae, text, dit_device, vae_device, dtype, dit_offload, vae_offload,
                  dit_placement, vae_placement)


def _ready_model(ref: ModelRef, opts: Options, dtype, device, offload):
    """A model and its placement: a given module moved as the options say, a file via the cache."""
    if ref.loaded:  # placed as a file's model would be, once per module and settings
        model = ref.model

        def place():
            model.to(device=device if offload is None else offload, dtype=dtype)
            return _place(model, ref.kind, opts, device, offload)
        return model, MODEL_CACHE.placement_of(
            model, _placed_as(opts, ref.kind, dtype, device, offload), place)
    key = ModelKey.for_file(ref.kind, ref.model, dtype, device, _settings_of(opts, ref.kind))
    return MODEL_CACHE.get_or_load(key, lambda: _load_file(ref, opts, dtype, device, offload),
                                   opts.cache_dit if ref.kind == "dit" else opts.cache_vae)


def resident_bytes(refs: tuple[ModelRef, ModelRef], opts: Options,
                   where: ModelDevices) -> dict[str, int]:
    """Bytes of a job's models already on each compute device before it loads them (a given
    module, or the cache's for these options): available to the budget, which counts them."""
    found = dict.fromkeys(where.compute, 0)
    for ref, device in zip(refs, (where.dit, where.vae)):
        if ref.loaded:
            model = ref.model
        else:
            key = ModelKey.for_file(ref.kind, ref.model, where.dtype, device,
                                    _settings_of(opts, ref.kind))
            model = (MODEL_CACHE.peek(key) or (None,))[0]
        for d in found:
            found[d] += mem.bytes_on(model, torch.device(d))
    return found
