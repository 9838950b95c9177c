"""Weight files -> models: one loader for every format (``load_dit``, ``load_vae``)."""

from .load import describe, load_dit, load_vae
from .source import CheckpointError

__all__ = ["CheckpointError", "describe", "load_dit", "load_vae"]
