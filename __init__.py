"""ComfyUI entry point of the SeedVR2 node pack.

Loaded by ComfyUI as a custom-node folder of any name; relative imports only, and importing
does no work (no models, no CUDA): the nodes import the library when they run. ComfyUI with the
V3 node schema gets ``comfy_entrypoint``; older ComfyUI (and plain Python) the classic
``NODE_CLASS_MAPPINGS``.
"""

# Only as a package (ComfyUI imports custom-node folders as packages). A test runner that
# collects this folder under a name that is no identifier (e.g. "ComfyUI-SeedVR2") imports the
# file as a plain module, where relative imports cannot work: it then defines nothing.
if __package__:
    from . import nodes as _nodes
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    # The editor extension (web/seedvr2.js): numz workflows opened in our layout, seeds start
    # as declared in older editors too, model downloads marked.
    WEB_DIRECTORY = "./web"
    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]

    if _nodes.API == "v3":
        from .nodes import comfy_entrypoint

        __all__.append("comfy_entrypoint")
