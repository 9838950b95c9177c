"""Feed-forward layers: SwiGLU (3B family) and GELU-tanh MLP (7B family)."""

from __future__ import annotations

import torch
from torch import nn

from .pointwise import gelu_tanh, silu


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in_gate = nn.Linear(dim, hidden, bias=False)
        self.proj_in = nn.Linear(dim, hidden, bias=False)
        self.proj_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(silu(self.proj_in_gate(x)) * self.proj_in(x))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in = nn.Linear(dim, hidden)
        self.proj_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(gelu_tanh(self.proj_in(x)))
