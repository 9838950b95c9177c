"""SeedVR2 one-step video/image super-resolution: library behind the ComfyUI nodes and the CLI.
Importing this package is cheap: submodules (and torch) load on first use.

    import seedvr2
    out = seedvr2.upscale(frames, resolution=1080)          # IMAGE (T, H, W, C) in [0, 1]
    seedvr2.upscale_file("in.mp4", "out.mp4", resolution=1080)

    from seedvr2.models import build_dit, build_vae
    from seedvr2.loading import load_dit, load_vae, describe
"""

from __future__ import annotations

import importlib

from .version import __version__

_SUBMODULES = {"models", "loading", "pipeline", "io", "memory", "options", "cli", "api"}
_FACADE = {"upscale", "upscale_file", "load_models"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _FACADE:
        return getattr(importlib.import_module(".api", __name__), name)
    if name == "SeedVR2Error":  # the base of every error raised on purpose (errors.py)
        return importlib.import_module(".errors", __name__).SeedVR2Error
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
