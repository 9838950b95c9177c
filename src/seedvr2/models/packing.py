"""Bookkeeping for native-resolution packing: several samples' tokens concatenated, no padding.

Everything here is known on the host, so index tensors are built on the CPU and sent in one copy
from pinned memory (:func:`to_device`), never read back (docs/models.md, "Packing")."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .window import WindowLayout, layout_for, split_rows, to_device


@dataclass
class Packing:
    """Per-call facts shared by all blocks: each sample's patched grid and text length."""

    patched_thw: list[tuple[int, int, int]]
    txt_lens: list[int]
    device: torch.device
    layouts: dict = field(default_factory=dict)
    # txt_lens, video counts and text positions on the device, sent together on first use.
    device_index: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.txt_lens)

    @property
    def vid_counts(self) -> list[int]:
        return [t * h * w for t, h, w in self.patched_thw]

    def _index(self, name: str) -> torch.Tensor:
        if "txt_lens" not in self.device_index:
            positions = [torch.arange(n) for n in self.txt_lens]
            parts = {"txt_lens": torch.tensor(self.txt_lens), "vid": torch.tensor(self.vid_counts),
                     "txt_positions": torch.cat(positions)}
            names = ["txt_lens", "vid", "txt_positions"]
            with torch.inference_mode(False):  # plain tensors: usable by autograd later too
                buffer = to_device(torch.cat([parts[n] for n in names]), self.device)
                views = split_rows(buffer, [len(parts[n]) for n in names])
            self.device_index.update(zip(names, views))
            self.device_index["txt"] = self.device_index["txt_lens"]
        return self.device_index[name]

    def txt_lens_tensor(self) -> torch.Tensor:
        return self._index("txt_lens")

    def txt_positions(self) -> torch.Tensor:
        """Position of each packed text token inside its own sample's text: (Nt,)."""
        return self._index("txt_positions")

    def layout(self, method: str, num: tuple[int, int, int]) -> WindowLayout:
        """The window layout for a rule (:func:`~.window.layout_for`), kept for this call."""
        key = (method, tuple(num))
        if key not in self.layouts:
            self.layouts[key] = layout_for(method, tuple(num), self.patched_thw, self.txt_lens,
                                           self.device)
        return self.layouts[key]

    def per_token(self, values: torch.Tensor, stream: str) -> torch.Tensor:
        """Expand per-sample rows (B, ...) to per-token rows of a stream (broadcast when B = 1;
        ``output_size`` given: CUDA need not read the counts back)."""
        if self.batch == 1:
            return values
        counts = self.vid_counts if stream == "vid" else self.txt_lens
        return values.repeat_interleave(self._index(stream).to(values.device), dim=0,
                                        output_size=sum(counts))
