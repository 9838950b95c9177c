"""Input/output embeddings of the NaDiT: patchify, text projection, timestep embedding."""

from __future__ import annotations

import math

import torch
from torch import nn

PATCH = 2  # spatial patch size (the temporal patch size is 1 for every released model)


class PatchIn(nn.Module):
    """(T, H, W, C) latent grid per sample -> (T, H/2, W/2) tokens of width ``dim``; the 4·C
    patch features ordered (ph, pw, c), as ``vid_in.proj``'s columns."""

    def __init__(self, in_channels: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(in_channels * PATCH * PATCH, dim)

    def forward(self, vid: torch.Tensor, thw: list[tuple[int, int, int]]) -> torch.Tensor:
        c = vid.shape[-1]
        patches = []
        for (t, h, w), x in zip(thw, vid.split([t * h * w for t, h, w in thw])):
            x = x.view(t, h // PATCH, PATCH, w // PATCH, PATCH, c)
            patches.append(x.permute(0, 1, 3, 2, 4, 5).reshape(-1, PATCH * PATCH * c))
        return self.proj(torch.cat(patches) if len(patches) > 1 else patches[0])


class PatchOut(nn.Module):
    """Inverse of :class:`PatchIn`: tokens -> (T·H·W, out_channels) in raster order."""

    def __init__(self, dim: int, out_channels: int):
        super().__init__()
        self.out_channels = out_channels
        self.proj = nn.Linear(dim, out_channels * PATCH * PATCH)

    def forward(self, x: torch.Tensor, thw: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.proj(x)
        c = self.out_channels
        out = []
        for (t, h, w), y in zip(thw, x.split([t * (h // PATCH) * (w // PATCH) for t, h, w in thw])):
            y = y.view(t, h // PATCH, w // PATCH, PATCH, PATCH, c)
            out.append(y.permute(0, 1, 3, 2, 4, 5).reshape(t * h * w, c))
        return torch.cat(out) if len(out) > 1 else out[0]


def sinusoidal_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0):
    """``[sin(t·f_k)] ++ [cos(t·f_k)]`` with ``f_k = exp(-ln(max_period)·k/(dim/2))``, fp32."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    angles = t.float()[:, None] * torch.exp(exponent / half)[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TimestepEmbedding(nn.Module):
    """Timestep -> the 6·dim modulation vector of each sample (``emb_in``)."""

    def __init__(self, hidden_dim: int, out_dim: int, sinusoidal_dim: int = 256):
        super().__init__()
        self.sinusoidal_dim = sinusoidal_dim
        self.proj_in = nn.Linear(sinusoidal_dim, hidden_dim)
        self.proj_hid = nn.Linear(hidden_dim, hidden_dim)
        self.proj_out = nn.Linear(hidden_dim, out_dim)
        self.act = nn.SiLU()

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, out_dim)
        x = sinusoidal_embedding(timestep, self.sinusoidal_dim).to(self.proj_in.weight.dtype)
        return self.proj_out(self.act(self.proj_hid(self.act(self.proj_in(x)))))
