"""RMS normalisation, always computed in float32 (the released models are sensitive to it)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last axis, in fp32, returned in fp32."""
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight.float()


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain (the official ``fusedrms``; parameter name ``weight``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight).to(x.dtype)
