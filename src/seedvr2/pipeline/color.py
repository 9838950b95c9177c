"""Colour correction of upscaled frames against the (resized) input video.

Every method takes ``content`` (the upscaled frames, carrying the detail) and ``style`` (the input
resized to the output size, carrying the colours we trust), both ``(T, 3, H, W)`` in [-1, 1], and
returns content re-coloured after style; all frames of one call are treated together. The methods
(``COLOR_METHODS``), their sources (official SeedVR2, numz, papers) and where we differ from numz:
docs/library.md (Colour correction).

Implementation: float32 throughout, content's dtype returned; a style of another size is resized
bilinearly (as numz). Per-pixel stages run a few frames at a time into preallocated outputs; only
histogram matching needs all pixels at once. The dilated blur is a depthwise ``conv2d`` on
accelerators and a separable sum of shifted slices on CPU, where dilated convolution falls back
to im2col (twice slower, several full-size buffers); both agree to ~1e-7. Measured peak memory
beyond the inputs, per pixel of ``T·H·W`` (CPU): wavelet ~24 B, lab ~40 B, hsv ~36 B,
wavelet_adaptive ~53 B, adain negligible."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError
from ..models.pointwise import power, sigmoid
from ..options import COLOR_CORRECTIONS, OptionError

COLOR_METHODS = COLOR_CORRECTIONS  # defined once, with the other options

WAVELET_LEVELS = 5
LAB_LUMINANCE_WEIGHT = 0.8

# sRGB (D65) <-> XYZ as in numz; the white point is folded into the matrices below.
_RGB_TO_XYZ = ((0.4124564, 0.3575761, 0.1804375),
               (0.2126729, 0.7151522, 0.0721750),
               (0.0193339, 0.1191920, 0.9503041))
_XYZ_TO_RGB = ((3.2404542, -1.5371385, -0.4985314),
               (-0.9692660, 1.8760108, 0.0415560),
               (0.0556434, -0.2040259, 1.0572252))
_WHITE_D65 = (0.95047, 1.0, 1.08883)
_LAB_EPS = 6.0 / 29.0
_LAB_KAPPA = (29.0 / 3.0) ** 3

HSV_HUE_BINS = 12
HSV_MIN_PIXELS = 100  # a sector is matched only with more pixels than this in both images
HSV_MIN_CHROMA = 1e-3
ADAPTIVE_THRESHOLD = 0.15
ADAPTIVE_SHARPNESS = 5.0

_CHUNK_PIXELS = 1 << 22  # per-pixel stages process about this many pixels at a time


def _prepare(content: Tensor, style: Tensor) -> tuple[Tensor, Tensor]:
    """float32 versions of both (no copy when already float32), style resized if needed."""
    if content.ndim != 4 or content.shape[1] != 3:
        raise InputError(f"content must be (T, 3, H, W), got {tuple(content.shape)}")
    if style.ndim != 4 or style.shape[1] != 3 or style.shape[0] != content.shape[0]:
        raise InputError(f"style must be (T, 3, H, W) with T = {content.shape[0]} like content, "
                         f"got {tuple(style.shape)}")
    content = content.float()
    style = style.to(device=content.device, dtype=torch.float32)
    if style.shape[-2:] != content.shape[-2:]:
        style = F.interpolate(style, size=content.shape[-2:], mode="bilinear", align_corners=False)
    return content, style


def framewise(fn: Callable, *inputs: Tensor):
    """``fn`` over a few frames of ``inputs`` at a time (as the first's pixels allow), its tensor(s)
    gathered in preallocated outputs: per-pixel work's temporaries stay one chunk's."""
    frames = inputs[0].shape[0]
    chunk = max(1, _CHUNK_PIXELS // max(1, inputs[0][0, 0].numel())) if frames else 1
    if chunk >= frames:
        return fn(*inputs)
    outputs = None
    for start in range(0, frames, chunk):
        part = fn(*(x[start:start + chunk] for x in inputs))
        single = isinstance(part, Tensor)
        parts = (part,) if single else part
        if outputs is None:
            outputs = tuple(p.new_empty((frames, *p.shape[1:])) for p in parts)
        for out, p in zip(outputs, parts):
            out[start:start + chunk] = p
        del part, parts
    return outputs[0] if single else outputs


def _to_unit(x: Tensor) -> Tensor:
    """[-1, 1] -> [0, 1], clamped; always a new tensor."""
    return x.add(1.0).mul_(0.5).clamp_(0.0, 1.0)


def _wavelet_radii(height: int, width: int, levels: int = WAVELET_LEVELS) -> list[int]:
    cap = max(1, min(height, width) // 8)
    return [min(2 ** i, cap) for i in range(levels)]


def _blur_conv(x: Tensor, radius: int) -> Tensor:
    channels = x.shape[1]
    taps = torch.tensor([1.0, 2.0, 1.0], dtype=x.dtype, device=x.device)
    kernel = (taps[:, None] * taps[None, :] / 16.0).expand(channels, 1, 3, 3).contiguous()
    padded = F.pad(x, (radius, radius, radius, radius), mode="replicate")
    return F.conv2d(padded, kernel, groups=channels, dilation=radius)


def _blur_shifted(x: Tensor, radius: int) -> Tensor:
    # Replicate padding clamps each axis independently, so the 2-D kernel separates exactly.
    height, width = x.shape[-2:]
    r = radius
    padded = F.pad(x, (r, r, r, r), mode="replicate")
    rows = padded[..., :height, :].add(padded[..., 2 * r:, :]).mul_(0.25)
    rows.add_(padded[..., r:r + height, :], alpha=0.5)
    del padded
    out = rows[..., :width].add(rows[..., 2 * r:]).mul_(0.25)
    return out.add_(rows[..., r:r + width], alpha=0.5)


def _binomial_blur(x: Tensor, radius: int) -> Tensor:
    """3×3 binomial blur dilated by ``radius``, replicate padding, per channel."""
    return _blur_shifted(x, radius) if x.device.type == "cpu" else _blur_conv(x, radius)


def wavelet_low(x: Tensor, levels: int = WAVELET_LEVELS) -> Tensor:
    """Low band of the à-trous pyramid of ``x`` (N, C, H, W): ``levels`` dilated blurs."""
    x = x.float()
    for radius in _wavelet_radii(*x.shape[-2:], levels):
        x = _binomial_blur(x, radius)
    return x


def wavelet_reconstruction(content: Tensor, style: Tensor, clamp: bool = True) -> Tensor:
    """``high(content) + low(style)``, clamped to [-1, 1] unless ``clamp=False``; computed as
    ``content + low(style − content)`` (the blur is linear, ``high(x) = x − low(x)``)."""
    dtype = content.dtype
    content, style = _prepare(content, style)
    out = wavelet_low(style - content).add_(content)
    if clamp:
        out.clamp_(-1.0, 1.0)
    return out.to(dtype)


def _mean_std(x: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    var, mean = torch.var_mean(x.flatten(2), dim=2, unbiased=True)
    return mean[..., None, None], var.add_(eps).sqrt_()[..., None, None]


def adain(content: Tensor, style: Tensor) -> Tensor:
    """Per frame and channel: content standardised, then given the style's mean and std. Not
    clamped (the reference is not); :func:`color_correct` clamps."""
    dtype = content.dtype
    content, style = _prepare(content, style)
    c_mean, c_std = _mean_std(content)
    s_mean, s_std = _mean_std(style)
    out = (content - c_mean).mul_(s_std / c_std).add_(s_mean)
    return out.to(dtype)


def _rgb_to_lab(rgb11: Tensor) -> Tensor:
    """(N, 3, H, W) sRGB in [-1, 1] (clamped to [0, 1] first) -> CIELAB, L in [0, 100]."""
    rgb = _to_unit(rgb11)
    linear = torch.where(rgb > 0.04045, power((rgb + 0.055) / 1.055, 2.4), rgb / 12.92)
    del rgb
    matrix = torch.tensor(_RGB_TO_XYZ, dtype=linear.dtype, device=linear.device)
    matrix = matrix / torch.tensor(_WHITE_D65, dtype=linear.dtype, device=linear.device)[:, None]
    xyz = torch.einsum("ij,njhw->nihw", matrix, linear)
    del linear
    f = torch.where(xyz > _LAB_EPS ** 3, power(xyz, 1.0 / 3.0),
                    xyz * (_LAB_KAPPA / 116.0) + 16.0 / 116.0)
    del xyz
    fx, fy, fz = f.unbind(1)
    return torch.stack([116.0 * fy - 16.0, 500.0 * (fx - fy), 200.0 * (fy - fz)], dim=1)


def _lab_to_rgb(lab: Tensor) -> Tensor:
    """CIELAB -> sRGB in [-1, 1] (clamped to the [0, 1] gamut first)."""
    L, a, b = lab.unbind(1)
    fy = (L + 16.0) / 116.0
    f = torch.stack([fy + a / 500.0, fy, fy - b / 200.0], dim=1)
    del fy
    xyz = torch.where(f > _LAB_EPS, f.pow(3.0), (116.0 * f - 16.0) / _LAB_KAPPA)
    del f
    matrix = torch.tensor(_XYZ_TO_RGB, dtype=lab.dtype, device=lab.device)
    matrix = matrix * torch.tensor(_WHITE_D65, dtype=lab.dtype, device=lab.device)[None, :]
    linear = torch.einsum("ij,njhw->nihw", matrix, xyz)
    del xyz
    rgb = torch.where(linear > 0.0031308,
                      power(linear.clamp(min=0.0), 1.0 / 2.4) * 1.055 - 0.055, linear * 12.92)
    return rgb.clamp_(0.0, 1.0).mul_(2.0).sub_(1.0)


def _quantile_positions(n_source: int, n_reference: int, rank: Tensor) -> Tensor:
    """Index into a sorted reference of length m for the rank-th of n sorted source values;
    integer arithmetic, so equal lengths map every rank to itself (no float linspace drift)."""
    return rank * max(n_reference - 1, 0) // max(n_source - 1, 1)


def match_histogram(source: Tensor, reference: Tensor) -> Tensor:
    """Exact sort-based histogram matching of all values of ``source`` to ``reference``
    (quantile mapping when the counts differ; stable sorts resolve ties by position)."""
    src = source.reshape(-1)
    ref_sorted = reference.reshape(-1).sort(stable=True).values
    order = src.sort(stable=True).indices
    n, m = src.numel(), ref_sorted.numel()
    if m != n:
        ref_sorted = ref_sorted[_quantile_positions(n, m, torch.arange(n, device=src.device))]
    # Scattering through the sort permutation inverts it without a second sort.
    out = torch.empty_like(src)
    out[order] = ref_sorted
    return out.reshape(source.shape)


def lab_transfer(content: Tensor, style: Tensor,
                 luminance_weight: float = LAB_LUMINANCE_WEIGHT) -> Tensor:
    """Wavelet result with a*, b* histogram-matched to the style and L partly matched."""
    dtype = content.dtype
    content, style = _prepare(content, style)
    content_lab = framewise(lambda c, s: _rgb_to_lab(wavelet_reconstruction(c, s)), content, style)
    style_lab = framewise(_rgb_to_lab, style)
    for channel in (1, 2):
        content_lab[:, channel] = match_histogram(content_lab[:, channel], style_lab[:, channel])
    if luminance_weight < 1.0:
        matched = match_histogram(content_lab[:, 0], style_lab[:, 0])
        content_lab[:, 0].mul_(luminance_weight).add_(matched, alpha=1.0 - luminance_weight)
        del matched
    del style_lab
    return framewise(_lab_to_rgb, content_lab).to(dtype)


def _saturation(x11: Tensor) -> Tensor:
    """HSV saturation (N, 1, H, W) of RGB in [-1, 1] after clamping to [0, 1]."""
    # max/min commute with the monotone map to [0, 1], so no clamped copy is needed.
    value = x11.amax(dim=1, keepdim=True).add_(1.0).mul_(0.5).clamp_(0.0, 1.0)
    low = x11.amin(dim=1, keepdim=True).add_(1.0).mul_(0.5).clamp_(0.0, 1.0)
    return value.sub(low).div_(value.clamp(min=1e-10))


def _hsv_key(x11: Tensor) -> Tensor:
    """Sort key ``sector + s/2`` (N, H, W) of RGB in [-1, 1]: pixels by hue sector, then
    saturation (s/2 < 1 keeps sectors apart; float32 resolves s to ~2e-6, plenty for a quantile
    mapping). Sector ``HSV_HUE_BINS`` holds the achromatic pixels."""
    rgb = _to_unit(x11)
    r, g, b = rgb.unbind(1)
    value, argmax = rgb.max(dim=1)
    chroma = value - rgb.amin(dim=1)
    safe = chroma.clamp(min=1e-12)
    # Hue in sixths of the circle, measured from whichever channel is largest.
    hue = torch.where(argmax == 0, torch.remainder((g - b) / safe, 6.0),
                      torch.where(argmax == 1, (b - r) / safe + 2.0, (r - g) / safe + 4.0))
    sector = torch.floor(hue.mul_(HSV_HUE_BINS / 6.0).add_(0.5)).remainder_(HSV_HUE_BINS)
    sector.masked_fill_(chroma < HSV_MIN_CHROMA, float(HSV_HUE_BINS))
    sat = chroma / value.clamp(min=1e-10)
    return sector.add_(sat, alpha=0.5)


def _hue_conditional_match(key: Tensor, ref_key: Tensor) -> Tensor:
    """Matched saturation per content pixel (flat), or -1 where it stays as it is. One sort per
    image; every sector is a contiguous run of it, found by binary search, matched on its own."""
    ref_sorted = ref_key.reshape(-1).sort(stable=True).values
    sorted_key, order = key.reshape(-1).sort(stable=True)
    edges = torch.arange(HSV_HUE_BINS + 1, dtype=sorted_key.dtype, device=sorted_key.device)
    starts = torch.searchsorted(sorted_key, edges).tolist() + [sorted_key.numel()]
    ref_starts = torch.searchsorted(ref_sorted, edges).tolist() + [ref_sorted.numel()]
    matched = torch.full_like(sorted_key, -1.0)
    for sector in range(HSV_HUE_BINS):
        lo, hi = starts[sector], starts[sector + 1]
        ref_lo, ref_hi = ref_starts[sector], ref_starts[sector + 1]
        n, m = hi - lo, ref_hi - ref_lo
        if n <= HSV_MIN_PIXELS or m <= HSV_MIN_PIXELS:
            continue
        ref = ref_sorted[ref_lo:ref_hi]
        if m != n:
            ref = ref[_quantile_positions(n, m, torch.arange(n, device=ref.device))]
        matched[lo:hi] = (ref - sector) * 2.0
    del sorted_key, ref_sorted
    out = torch.empty_like(matched)
    out[order] = matched
    return out


def _rescale_chroma(x11: Tensor, new_sat: Tensor) -> Tensor:
    """RGB in [-1, 1] with saturation ``new_sat`` (-1: unchanged), hue and value kept."""
    rgb = _to_unit(x11)
    value = rgb.amax(dim=1, keepdim=True)
    chroma = value[:, 0] - rgb.amin(dim=1)
    # Each channel is v − v·s·w(hue): scaling (v − c) by s'/s = s'·v/chroma changes s only.
    keep = (new_sat < 0.0).unsqueeze(1)
    ratio = new_sat * value[:, 0] / chroma.clamp(min=1e-12)
    out = (value - rgb).mul_(ratio.unsqueeze(1)).neg_().add_(value)
    out = out.clamp_(0.0, 1.0).mul_(2.0).sub_(1.0)
    # Untouched pixels are returned bit-exact rather than through the [0, 1] round trip.
    return torch.where(keep, x11.clamp(-1.0, 1.0), out)


def hsv_match(content: Tensor, style: Tensor) -> Tensor:
    """Content with its saturation matched to the style's per hue sector; hue and value kept."""
    dtype = content.dtype
    content, style = _prepare(content, style)
    key = framewise(_hsv_key, content)
    ref_key = framewise(_hsv_key, style)
    new_sat = _hue_conditional_match(key, ref_key).reshape(key.shape)
    del key, ref_key
    return framewise(_rescale_chroma, content, new_sat).to(dtype)


def wavelet_adaptive(content: Tensor, style: Tensor) -> Tensor:
    """Wavelet result, blended toward the hsv result where it stays over-saturated."""
    dtype = content.dtype
    content, style = _prepare(content, style)
    base = wavelet_reconstruction(content, style)
    style_sat = _saturation(style)
    still_over = (_saturation(base) - style_sat) > ADAPTIVE_THRESHOLD * 0.5
    if not bool(still_over.any()):
        return base.to(dtype)
    excess = _saturation(content).sub_(style_sat).sub_(ADAPTIVE_THRESHOLD)
    weight = sigmoid(excess.mul_(ADAPTIVE_SHARPNESS))
    del style_sat
    weight.mul_(still_over)
    del still_over
    corrected = hsv_match(content, style)
    return base.lerp_(corrected, weight).to(dtype)


def color_correct(content: Tensor, style: Tensor, method: str) -> Tensor:
    """Re-colour ``content`` after ``style`` (both (T, 3, H, W) in [-1, 1]) with ``method``:
    content's dtype and device, values in [-1, 1]; ``"none"`` returns content itself."""
    if method not in COLOR_METHODS:
        raise OptionError(f"color_correction {method!r}: expected one of "
                          f"{', '.join(COLOR_METHODS)}")
    if method == "none":
        return content
    if method == "adain":
        return adain(content, style).clamp_(-1.0, 1.0)
    return {"wavelet": wavelet_reconstruction, "lab": lab_transfer, "hsv": hsv_match,
            "wavelet_adaptive": wavelet_adaptive}[method](content, style)


__all__ = ["COLOR_METHODS", "adain", "color_correct", "hsv_match", "lab_transfer",
           "match_histogram", "wavelet_adaptive", "wavelet_low", "wavelet_reconstruction"]
