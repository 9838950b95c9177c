"""SeedVR2 models in pure torch: the NaDiT (3B and 7B families) and the causal video VAE.

Nothing here knows about files, devices or processes; ``seedvr2.loading`` builds these
modules from checkpoints.
"""

from __future__ import annotations

import torch

from .config import ConfigError, DiTConfig, VAEConfig, dit_config, vae_config


def build_dit(config) -> torch.nn.Module:
    """A NaDiT of either family from a config (dict with official keys, name, or DiTConfig).

    Parameters are created on the current default device; build under
    ``torch.device("meta")`` to allocate nothing.
    """
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


__all__ = ["ConfigError", "DiTConfig", "VAEConfig", "build_dit", "build_on_meta", "build_vae",
           "dit_config", "vae_config"]
