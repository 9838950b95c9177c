"""Alpha-channel upscaling for RGBA inputs, guided by the upscaled colour image: a bicubic
base limited to the input's local range, a guided filter on the RGB's luminance used where it
explains alpha, hard mattes sharpened. The steps and their reasons: docs/library.md (Alpha)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError
from ..models.pointwise import sigmoid
from .color import framewise

GUIDED_EPS = 3e-4
MAX_RADIUS = 8
RANGE_WINDOW = 3
BINARY_TOLERANCE = 0.1
BINARY_FRACTION = 0.95
RIM_WINDOW = 5
SHARPEN_GAIN = 12.0
_CORRELATION_EPS = 1e-4  # variance floor of alpha in the correlation, ~0.01 alpha std
_LUMA = (0.2126, 0.7152, 0.0722)  # Rec. 709


def _box(x: Tensor, radius: int) -> Tensor:
    """Mean over a (2r+1)² window, averaging only pixels inside the image."""
    size = 2 * radius + 1
    # The valid part of a window is a rectangle, so two 1-D means compose exactly.
    x = F.avg_pool2d(x, (size, 1), stride=1, padding=(radius, 0), count_include_pad=False)
    return F.avg_pool2d(x, (1, size), stride=1, padding=(0, radius), count_include_pad=False)


def _dilate(x: Tensor, radius: int) -> Tensor:
    """Max over a (2r+1)² window (separable)."""
    size = 2 * radius + 1
    x = F.max_pool2d(x, (size, 1), stride=1, padding=(radius, 0))
    return F.max_pool2d(x, (1, size), stride=1, padding=(0, radius))


def _guided_filter(guide: Tensor, src: Tensor, radius: int, eps: float) -> tuple[Tensor, Tensor]:
    """Guided filter output and its confidence (dilated squared guide/src correlation)."""
    mean_i, mean_p = _box(guide, radius), _box(src, radius)
    var_i = _box(guide * guide, radius).sub_(mean_i * mean_i).add_(eps)
    var_p = _box(src * src, radius).sub_(mean_p * mean_p).add_(_CORRELATION_EPS)
    cov = _box(guide * src, radius).sub_(mean_i * mean_p)
    confidence = _dilate((cov * cov).div_(var_i * var_p).clamp_(0.0, 1.0), radius)
    del var_p
    a = cov.div_(var_i)
    del var_i
    b = mean_p.sub_(a * mean_i)
    del mean_i
    return _box(a, radius).mul_(guide).add_(_box(b, radius)), confidence


def _sharpen(x: Tensor) -> Tensor:
    """Sigmoid contrast around 0.5, rescaled so that 0 -> 0 and 1 -> 1."""
    half = SHARPEN_GAIN / 2.0
    low = 1.0 / (1.0 + math.exp(half))
    high = 1.0 / (1.0 + math.exp(-half))
    return sigmoid((x - 0.5) * SHARPEN_GAIN).sub_(low).div_(high - low)


def _is_hard_matte(alpha: Tensor) -> bool:
    """True when (almost) every pixel is near 0, near 1, or on a thin rim between both."""
    near0 = alpha <= BINARY_TOLERANCE
    near1 = alpha >= 1.0 - BINARY_TOLERANCE
    has0 = _dilate(near0.float(), RIM_WINDOW // 2) > 0
    has1 = _dilate(near1.float(), RIM_WINDOW // 2) > 0
    settled = near0 | near1 | (has0 & has1)
    return bool(settled.float().mean() >= BINARY_FRACTION)


def _local_range(alpha: Tensor, size: tuple[int, int], window: int) -> tuple[Tensor, Tensor]:
    """Min and max of alpha over a window around each output pixel's nearest source pixel."""
    high, low = _dilate(alpha, window // 2), -_dilate(-alpha, window // 2)
    return (F.interpolate(low, size=size, mode="nearest"),
            F.interpolate(high, size=size, mode="nearest"))


def _upscale_chunk(alpha: Tensor, rgb: Tensor, radius: int, window: int, hard: bool) -> Tensor:
    size = tuple(rgb.shape[-2:])
    shrinks = size[0] < alpha.shape[-2] or size[1] < alpha.shape[-1]
    base = F.interpolate(alpha, size=size, mode="bicubic", align_corners=False, antialias=shrinks)
    low, high = _local_range(alpha, size, window)
    base = torch.clamp(base, low, high)

    weights = torch.tensor(_LUMA, dtype=rgb.dtype, device=rgb.device).view(1, 3, 1, 1)
    luma = (rgb.clamp(0.0, 1.0) * weights).sum(dim=1, keepdim=True)
    filtered, confidence = _guided_filter(luma, base, radius, GUIDED_EPS)
    del luma
    refined = base.lerp_(filtered, confidence)
    del filtered, confidence
    if hard:
        refined = _sharpen(refined)
    return torch.clamp(refined, low, high)


def upscale_alpha(alpha: Tensor, rgb: Tensor) -> Tensor:
    """Alpha (T, 1, h, w) in [0, 1] resized to the upscaled RGB (T, 3, H, W) in [0, 1], in alpha's
    dtype on rgb's device: edges aligned with the RGB's, hard mattes sharpened (docs/library.md)."""

    if alpha.ndim != 4 or alpha.shape[1] != 1:
        raise InputError(f"alpha must be (T, 1, h, w), got {tuple(alpha.shape)}")
    if rgb.ndim != 4 or rgb.shape[1] != 3 or rgb.shape[0] != alpha.shape[0]:
        raise InputError(f"rgb must be (T, 3, H, W) with T = {alpha.shape[0]} like alpha, "
                         f"got {tuple(rgb.shape)}")
    height, width = rgb.shape[-2:]
    src = alpha.to(device=rgb.device, dtype=torch.float32).clamp(0.0, 1.0)
    scale = max(height / src.shape[-2], width / src.shape[-1])
    radius = min(MAX_RADIUS, 2 * math.ceil(scale))
    # When shrinking, one output pixel draws on several source pixels: widen the range window.
    window = RANGE_WINDOW if scale >= 1.0 else 2 * math.ceil(1.0 / scale) + 1
    hard = _is_hard_matte(src)
    # A few frames at a time, as many as output pixels allow.
    return framewise(lambda color, a: _upscale_chunk(a, color.float(), radius, window, hard)
                     .clamp_(0.0, 1.0), rgb, src).to(alpha.dtype)


__all__ = ["upscale_alpha"]
