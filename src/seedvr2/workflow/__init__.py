"""Our ComfyUI nodes defined once, and running workflows without the editor.

* :mod:`.nodes` -- the node definitions (inputs, outputs, what each node does), independent of
  ComfyUI. The ComfyUI pack (top-level ``nodes.py``) turns them into V3 or classic nodes;
  the headless runner calls them directly.
* :mod:`.core_nodes` -- headless equivalents of the ComfyUI core nodes our examples use
  (LoadImage, SaveImage, PreviewImage, LoadVideo, GetVideoComponents, CreateVideo, SaveVideo).
* :mod:`.convert` -- UI-format (editor) workflow -> API-format prompt.
* :mod:`.numz` -- workflows saved with the numz pack (four of our node IDs are its own, with
  another layout) rewritten to our layout: editor and API format.
* :mod:`.execute` -- runs an API-format prompt in this process.
* :mod:`.server` -- runs a prompt on a running ComfyUI server (uploads its input files,
  follows it on the websocket with ``websocket-client``, downloads the outputs).
* :mod:`.run` -- ``run_workflow``, behind ``seedvr2 run-workflow``.
* :mod:`.comfy_memory` -- inside ComfyUI: our cached models handed to it as ModelPatchers,
  so its memory management can evict them.

Importing this package is cheap: nothing here imports torch, PyAV or the models at import time.
"""

from __future__ import annotations

import importlib

_LAZY = {"run_workflow": ".run", "WorkflowError": ".errors"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
