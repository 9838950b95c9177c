"""ComfyUI entry point of the SeedVR2 node pack.

Loaded by ComfyUI as a custom-node folder of any name; relative imports only, and importing
does no work (no models, no CUDA): the nodes import the library when they run.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
