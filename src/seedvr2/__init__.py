"""SeedVR2 one-step video/image super-resolution: library behind the ComfyUI nodes and the CLI.

Importing this package is cheap: submodules (and torch) load on first use.

    from seedvr2.models import build_dit, build_vae
    from seedvr2.loading import load_dit, load_vae, describe
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = {"models", "loading", "cli"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
