"""AdaSingle modulation: one timestep embedding per sample, plus learned vectors per block.

The 6·dim embedding is read as ``[dim, 2, 3]``: channel, then slot (attention, mlp), then (shift,
scale, gate). "In" modulation is ``x·scale + shift`` (not ``1 + scale``), "out" is ``x·gate``; each
adds the block's own learned vector to the embedding's value."""

from __future__ import annotations

import torch
from torch import nn

ATTN, MLP = 0, 1
SHIFT, SCALE, GATE = 0, 1, 2


def embedding_slot(emb: torch.Tensor, slot: int, part: int) -> torch.Tensor:
    """(B, 6·dim) embedding -> (B, dim) values of one slot/part."""
    return emb.unflatten(-1, (-1, 2, 3))[:, :, slot, part]


class Modulation(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        for slot in ("attn", "mlp"):
            for part in ("shift", "scale", "gate"):
                setattr(self, f"{slot}_{part}", nn.Parameter(torch.zeros(dim)))

    def values(self, emb: torch.Tensor, slot: int):
        """Per-sample (shift, scale, gate), each (B, dim)."""
        name = ("attn", "mlp")[slot]
        return tuple(embedding_slot(emb, slot, part) + getattr(self, f"{name}_{label}")
                     for part, label in enumerate(("shift", "scale", "gate")))
