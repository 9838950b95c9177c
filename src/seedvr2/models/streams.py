"""Per-stream weights: the video and text streams of a block have separate weights
(``.vid`` / ``.txt``) or share one set (``.all``), exactly as the checkpoint keys say."""

from __future__ import annotations

from typing import Callable

from torch import nn


class PerStream(nn.Module):
    def __init__(self, make: Callable[[], nn.Module], shared: bool, vid_only: bool = False):
        super().__init__()
        self.shared = shared
        if shared:
            self.all = make()
        else:
            self.vid = make()
            if not vid_only:
                self.txt = make()

    def __getitem__(self, stream: str) -> nn.Module:
        return self.all if self.shared else getattr(self, stream)
