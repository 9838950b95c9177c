"""Our ComfyUI nodes defined once (:mod:`.nodes`), and running workflows without the editor
(:mod:`.run`, behind ``seedvr2 run-workflow``); the package's map: docs/development.md.

Importing this package is cheap: nothing here imports torch, PyAV or the models at import time.
"""

from __future__ import annotations

import importlib

_LAZY = {"run_workflow": ".run", "WorkflowError": ".errors"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
