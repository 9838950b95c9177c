"""Live previews: the newest finished frame, small and at most about once a second.

Whoever blends batches into final frames hands each to a :class:`FramePreview`, which passes a
thumbnail of the newest to the host's ``show`` (ComfyUI's progress-bar preview) once
:data:`PREVIEW_INTERVAL_S` has passed, never one per frame (docs/comfyui.md, "Live previews")."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

PREVIEW_INTERVAL_S = 1.0
PREVIEW_MAX_SIDE = 512  # ComfyUI's default preview size (its --preview-size)

# show(thumbnail): a (h, w, 3) uint8 CPU tensor, its longest side at most PREVIEW_MAX_SIDE.
Show = Callable[[torch.Tensor], None]


def thumbnail(frame: torch.Tensor, max_side: int = PREVIEW_MAX_SIDE) -> torch.Tensor:
    """``frame`` ((H, W, C) or (1, H, W, C), float in [0, 1] or uint8, any device, C = 1, 3
    or 4) as a (h, w, 3) uint8 CPU tensor, longest side at most ``max_side``: shrunk on its
    own device first, so only the small picture is copied; gray as three channels, no alpha."""
    image = frame[0] if frame.dim() == 4 else frame
    image = image[..., :3] if image.shape[-1] >= 3 else image[..., :1].expand(-1, -1, 3)
    height, width = image.shape[:2]
    scale = max_side / max(height, width)
    if image.dtype == torch.uint8:
        image = image.float() / 255
    if scale < 1:
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
        image = F.interpolate(image.float().permute(2, 0, 1)[None], size=size, mode="area")[0] \
            .permute(1, 2, 0)
    return (image.float().clamp(0, 1) * 255 + 0.5).to(torch.uint8).cpu()


class FramePreview:
    """``preview(frame)`` for every finished frame; ``show`` sees a :func:`thumbnail` of the
    first and then of the newest one at most once per ``interval_s``."""

    def __init__(self, show: Show, interval_s: float = PREVIEW_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.show, self.interval_s, self.clock = show, interval_s, clock
        self._last: Optional[float] = None

    def __call__(self, frame: torch.Tensor) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            return
        self._last = now
        self.show(thumbnail(frame))
