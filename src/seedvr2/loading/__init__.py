"""Weight files -> models: one loader for every format (``load_dit``, ``load_vae``)."""

from .formats import CheckpointError
from .load import describe, load_dit, load_vae

__all__ = ["CheckpointError", "describe", "load_dit", "load_vae"]
