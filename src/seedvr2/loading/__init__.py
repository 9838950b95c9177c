"""Weight files -> models: one loader for every format (``load_dit``, ``load_vae``).

Submodules load on first use, so listing model files (``registry``) does not import torch or
the model code.
"""

from __future__ import annotations

import importlib

_LAZY = {"CheckpointError": ".source", "describe": ".load", "load_dit": ".load",
         "load_vae": ".load"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
