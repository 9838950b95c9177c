"""ComfyUI nodes: thin adapters over the ``seedvr2`` library in ``src/seedvr2``.

The node set arrives with the nodes issue; until then the pack registers nothing, so that
ComfyUI loads it cleanly.
"""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
