"""Pointwise functions whose bits on the CPU do not depend on the thread count: SiLU, sigmoid,
tanh-GELU and powers.

PyTorch's CPU kernels for these compute most elements with vector code and the last few of each
thread's share with scalar code, and the two round differently (in the last bit on ~4 % of SiLU's
values, ~65 % of ``pow(x, 2.4)``'s). Where the shares meet depends on the thread count, so one
process and two ranks of 1 thread each differed by 1/255 in a few frames (issue 44). ``exp``,
``log``, ``tanh`` and arithmetic give the same bits on either path, so these compositions of them do
not depend on the split; they cost a few more passes over the tensor (bench/RESULTS.md)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_PIECE_ELEMENTS = 1 << 22  # in place: a temporary this large at a time, not the tensor's size


def sigmoid(x: Tensor) -> Tensor:
    if x.device.type != "cpu":
        return torch.sigmoid(x)
    return 1 / (torch.exp(-x) + 1)


def silu(x: Tensor, inplace: bool = False) -> Tensor:
    if x.device.type != "cpu":
        return F.silu(x, inplace=inplace)
    if not inplace:
        return x / (torch.exp(-x) + 1)
    dim = next((d for d, n in enumerate(x.shape) if n > 1), 0)
    step = max(1, _PIECE_ELEMENTS * x.shape[dim] // max(x.numel(), 1))
    for piece in x.split(step, dim):  # a view's pieces: views
        piece.div_(torch.neg(piece).exp_().add_(1))
    return x


def gelu_tanh(x: Tensor) -> Tensor:
    if x.device.type != "cpu":
        return F.gelu(x, approximate="tanh")
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))


def power(x: Tensor, exponent: float) -> Tensor:
    """``x ** exponent`` for ``x >= 0`` (0 gives 0)."""
    if x.device.type != "cpu":
        return x.pow(exponent)
    return torch.log(x).mul_(exponent).exp_()
