"""Bookkeeping for native-resolution packing: several samples' tokens concatenated, no padding."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .window import WindowLayout


@dataclass
class Packing:
    """Per-call facts shared by all blocks: each sample's patched grid and text length."""

    patched_thw: list[tuple[int, int, int]]
    txt_lens: list[int]
    device: torch.device
    layouts: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.txt_lens)

    @property
    def vid_counts(self) -> list[int]:
        return [t * h * w for t, h, w in self.patched_thw]

    def txt_lens_tensor(self) -> torch.Tensor:
        return torch.tensor(self.txt_lens, device=self.device)

    def txt_positions(self) -> torch.Tensor:
        """Position of each packed text token inside its own sample's text: (Nt,)."""
        return torch.cat([torch.arange(n, device=self.device) for n in self.txt_lens])

    def layout(self, method: str, num: tuple[int, int, int]) -> WindowLayout:
        """Window layout for a rule, built once per call and shared by the blocks using it."""
        key = (method, tuple(num))
        if key not in self.layouts:
            self.layouts[key] = WindowLayout.build(method, num, self.patched_thw, self.txt_lens,
                                                   self.device)
        return self.layouts[key]

    def per_token(self, values: torch.Tensor, stream: str) -> torch.Tensor:
        """Expand per-sample rows (B, ...) to per-token rows of a stream (broadcast when B = 1)."""
        if self.batch == 1:
            return values
        counts = self.vid_counts if stream == "vid" else self.txt_lens
        return values.repeat_interleave(torch.tensor(counts, device=values.device), dim=0)
