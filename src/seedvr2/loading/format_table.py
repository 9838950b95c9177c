"""Every storage format of ``loading/``, imported so that each registers its row of
:data:`~.packed.FORMATS`: whatever reads the table imports this module first. A new format is
one module that registers its row, and one name below."""

from __future__ import annotations

from . import fp8, gguf, int8, mxfp8, nvfp4  # noqa: F401 -- each registers its format
from .packed import FORMATS, MARKERS, SCHEMES, TARGETS, bytes_per_weight

__all__ = ["FORMATS", "MARKERS", "SCHEMES", "TARGETS", "bytes_per_weight"]
