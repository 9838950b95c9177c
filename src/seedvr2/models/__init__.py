"""SeedVR2 models in pure torch: the NaDiT (3B and 7B families) and the causal video VAE.

Nothing here knows weight files, ComfyUI or processes (``seedvr2.loading`` builds the modules from
checkpoints); the models read their shipped configs (``configs/*.json``) and, of the device, only
what picks a kernel (attention backend) or keys a cache (layouts per CUDA stream)."""

from __future__ import annotations

import torch

from .config import ConfigError, DiTConfig, VAEConfig, dit_config, vae_config


def build_dit(config) -> torch.nn.Module:
    """A NaDiT of either family from a config (dict with official keys, name, or DiTConfig),
    on the current default device (``torch.device("meta")``: nothing allocated)."""
    from .dit import NaDiT

    return NaDiT(dit_config(config))


def build_vae(config) -> torch.nn.Module:
    """The causal video VAE from a config (dict with official keys, ``"vae"``, or VAEConfig)."""
    from .vae import VideoAutoencoder

    return VideoAutoencoder(vae_config(config))


def build_on_meta(kind: str, config) -> torch.nn.Module:
    """The DiT (``kind`` "dit") or the VAE from ``config``, on ``meta``: nothing allocated."""
    with torch.device("meta"):
        return build_dit(config) if kind == "dit" else build_vae(config)


def set_tensor(module: torch.nn.Module, name: str, tensor: torch.Tensor):
    """Replace the parameter or buffer ``name`` (dotted) of ``module`` by ``tensor``."""
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if attr in owner._parameters:
        owner._parameters[attr] = tensor if isinstance(tensor, torch.nn.Parameter) else \
            torch.nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[attr] = tensor


__all__ = ["ConfigError", "DiTConfig", "VAEConfig", "build_dit", "build_on_meta", "build_vae",
           "dit_config", "set_tensor", "vae_config"]
