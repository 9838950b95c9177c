"""Building blocks of the causal video VAE on ``(B, C, T, H, W)`` tensors (see ``vae.py``).

Convolutions never look ahead (:class:`CausalConv3d`), everything else acts per frame; a
:class:`CausalCache` carries state between temporal chunks and hands spatial tiles whole-frame norm
statistics. Names follow the official checkpoint (strict loading). See docs/models.md."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError
from . import vae_paths
from .pointwise import silu
from .vae_paths import TODAY, PackedTail, VaePaths, copy_tail

_int3 = Union[int, Tuple[int, int, int]]
NORM_EPS = 1e-6

# Largest attention score matrix (elements) per SDPA call. If no fused kernel takes the shape
# (flash kernels stop at head dim 256; the released model attends with one head of 512) SDPA
# materialises ``N x N`` scores per frame, so frames are attended in groups within this budget.
ATTENTION_SCORE_BUDGET = 1 << 28

# Largest tensor (elements) one conv3d call reads or writes, and largest norm input upcast to
# float32 in one piece: well under cuDNN's 2^31 limit (docs/models.md, "Large tensors"). A
# module attribute, so that tests (and anyone on an old cuDNN short of memory) can lower it.
SPLIT_ELEMENTS = 1 << 30


def _records_graph(*tensors: Tensor) -> bool:
    """Whether autograd records ops on ``tensors`` (else the in-place fast paths run)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _triple(value: _int3) -> Tuple[int, int, int]:
    return (value,) * 3 if isinstance(value, int) else tuple(value)


def conv3d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: _int3 = 1,
           padding: _int3 = 0, paths: VaePaths = TODAY) -> Tensor:
    """``F.conv3d`` on the VAE's kernel paths (``vae_paths``), channels-first out.
    ``paths.channels_last``: on NDHWC input and weight (cuDNN's tensor-core layout; padded
    buffers and their bands are NDHWC already), the result channels-first again for the code
    around it. ``paths.fp16_accumulation`` (fp16): comfy-kitchen's ``fp16_conv3d``."""
    if paths.fp16_accumulation and x.dtype == torch.float16:
        pt, ph, pw = _triple(padding)
        return vae_paths.fp16_conv3d(x, weight, bias, stride, (pw, pw, ph, ph, pt, pt))
    if not paths.channels_last:
        if x.device.type == "cpu" and _is_pointwise(weight, stride, padding):
            return _pointwise_conv3d(x, weight, bias)
        return F.conv3d(x, weight, bias, stride, padding)
    layout = torch.channels_last_3d
    return F.conv3d(x.contiguous(memory_format=layout), weight.contiguous(memory_format=layout),
                    bias, stride, padding).contiguous()


def _is_pointwise(weight: Tensor, stride: _int3, padding: _int3) -> bool:
    return weight.shape[2:] == (1, 1, 1) and _triple(stride) == (1, 1, 1) and \
        _triple(padding) == (0, 0, 0)


def _pointwise_conv3d(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """A 1x1x1 convolution as matrix products over the channels, a frame at a time (a view
    input is never copied whole). oneDNN's 1x1x1 kernel splits the channel sum by the thread
    count, so 1 and 2 threads differ in the last bit; the matrix product sums in the same
    order at any thread count (tests/test_determinism.py)."""
    B, C, T, H, W = x.shape
    matrix = weight.reshape(weight.shape[0], C)
    if _records_graph(x, weight, *(() if bias is None else (bias,))):
        out = torch.matmul(matrix, x.reshape(B, C, T * H * W)).view(B, -1, T, H, W)
        return out if bias is None else out + bias.view(1, -1, 1, 1, 1)
    out = x.new_empty(B, matrix.shape[0], T, H, W)
    rows = out.view(B, -1, T, H * W)
    for b, t in itertools.product(range(B), range(T)):
        # Straight into the output: BLAS takes its rows T*H*W apart (a leading dimension).
        torch.mm(matrix, x[b, :, t].reshape(C, H * W), out=rows[b, :, t])
    if bias is not None:
        out.add_(bias.view(1, -1, 1, 1, 1))
    return out


@dataclass(frozen=True)
class ConvSpec:
    """One convolution's weights, geometry and kernel paths, as :func:`conv_rows` runs it."""

    weight: Tensor
    bias: Optional[Tensor]
    stride: Tuple[int, int, int] = (1, 1, 1)
    padding: Tuple[int, int, int] = (0, 0, 0)
    paths: VaePaths = TODAY

    def fp16(self) -> bool:  # the conv goes to fp16_conv3d
        return self.paths.fp16_accumulation and self.weight.dtype == torch.float16


def conv3d_in_bands(x: Tensor, spec: ConvSpec, limit: Optional[int] = None,
                    out: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """``F.conv3d`` of ``x`` with ``spec`` (plus ``residual``), in bands of output rows when the
    input or output has over ``limit`` (:data:`SPLIT_ELEMENTS`) elements, each reading exactly
    its rows and halo: every output element the same sum (docs/models.md, "Large tensors").
    Into ``out`` when given (any strides: a view into a padded buffer)."""
    B, C, T, H, W = x.shape
    rows = RowSource(lambda a, b: x[:, :, :, a:b], (B, C, T, H, W), B * C * T * W)
    return conv_rows(rows, spec, limit, out, residual)


class RowSource:
    """An input ``(B, C, T, H, W)`` for :func:`conv_rows` as bands of rows: ``band(a, b)``
    makes rows ``[a, b)`` on demand (a view, or computed from a smaller input);
    ``row_elements``: the most elements one row makes, so that bands stay within the limit."""

    def __init__(self, band, shape: Sequence[int], row_elements: int) -> None:
        self.band, self.shape, self.row_elements = band, tuple(shape), row_elements


def conv_rows(rows: RowSource, spec: ConvSpec, limit: Optional[int] = None,
              out: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """:func:`conv3d_in_bands` on a :class:`RowSource`. Over ``limit``, bands of at most a
    quarter of it (input, output and copies are temporaries; the fp16 path, which pads first,
    goes whole up to half). An edge band uses the conv's own row padding and drops the rows it
    adds past the band (stride 1 in H; a strided conv pads a copy)."""
    limit = SPLIT_ELEMENTS if limit is None else limit
    B, C, T, H, W = rows.shape
    O, _, kt, kh, kw = spec.weight.shape
    out_t, out_h, out_w = ((n + 2 * p - k) // s + 1 for n, p, k, s in
                           zip((T, H, W), spec.padding, (kt, kh, kw), spec.stride))
    out_row = B * O * out_t * out_w
    # Into a given buffer, the whole output would be a second full-size tensor beside it: then
    # bands from a quarter of the limit on, as over it.
    whole = limit // 4 if out is not None else limit // 2 if spec.fp16() else limit
    if max(rows.row_elements * H, out_row * out_h) <= whole:
        y = _conv_band(rows, spec, (0, out_h), residual)
        return y if out is None else out.copy_(y)
    band_limit = limit // 4
    count = max(1, min(band_limit // out_row,
                       (band_limit // rows.row_elements - kh) // spec.stride[1] + 1))
    if out is None:
        out = spec.weight.new_empty(B, O, out_t, out_h, out_w)
    for o0 in range(0, out_h, count):
        o1 = min(o0 + count, out_h)
        out[:, :, :, o0:o1] = _conv_band(rows, spec, (o0, o1), residual)
    return out


def _conv_band(rows: RowSource, spec: ConvSpec, band: Tuple[int, int],
               residual: Optional[Tensor]) -> Tensor:
    """Output rows ``[o0, o1)`` of :func:`conv_rows` (all of them: one call)."""
    o0, o1 = band
    H, kh = rows.shape[3], spec.weight.shape[3]
    (pt, ph, pw), sh = spec.padding, spec.stride[1]
    lo, hi = o0 * sh - ph, (o1 - 1) * sh - ph + kh
    x = rows.band(max(lo, 0), min(hi, H))
    if residual is not None:
        residual = residual[:, :, :, o0:o1]
    if spec.fp16():  # the kernel pads nothing: the missing rows, columns and frames here
        return vae_paths.fp16_conv3d(x, spec.weight, spec.bias, spec.stride,
                                     (pw, pw, max(-lo, 0), max(hi - H, 0), pt, pt), residual)
    if lo == -ph and hi - H == ph or lo >= 0 and hi <= H:  # all rows, or none at an edge
        y = conv3d(x, spec.weight, spec.bias, spec.stride, (pt, ph if lo < 0 else 0, pw),
                   spec.paths)
    elif sh == 1:  # the conv pads the clipped rows itself; drop what it adds past the band
        y = conv3d(x, spec.weight, spec.bias, spec.stride, spec.padding, spec.paths)
        start = o0 - max(lo, 0)  # band output j is output row max(lo, 0) + j
        y = y[:, :, :, start:start + (o1 - o0)]
    else:
        x = F.pad(x, (0, 0, max(-lo, 0), max(hi - H, 0)))
        y = conv3d(x, spec.weight, spec.bias, spec.stride, (pt, 0, pw), spec.paths)
    return y if residual is None else y.add_(residual)


def frame_group_stats(x: Tensor, groups: int) -> Tuple[Tensor, Tensor]:
    """Per-frame GroupNorm mean and (biased) variance ``(B, groups, 1, T)`` of ``x`` ``(B, C, T,
    N)`` in its dtype: per-channel moments over the contiguous ``N`` axis, combined exactly."""
    var_c, mean_c = torch.var_mean(x, dim=-1, correction=0)  # (B, C, T) per plane
    return group_stats_from_channels(mean_c, var_c, groups)


def group_stats_from_channels(mean_c: Tensor, var_c: Tensor, groups: int) -> Tuple[Tensor, Tensor]:
    """Group mean and variance ``(B, G, 1, T)`` from per-channel ones (law of total variance)."""
    B, C, T = mean_c.shape
    mean_c = mean_c.view(B, groups, C // groups, T)
    var_c = var_c.view(B, groups, C // groups, T)
    mean_g = mean_c.mean(dim=2, keepdim=True)  # (B, G, 1, T)
    spread = (mean_c - mean_g).square().mean(dim=2, keepdim=True)
    return mean_g, var_c.mean(dim=2, keepdim=True) + spread


class CausalCache:
    """State carried between the temporal chunks of one clip (a fresh cache per clip and direction,
    chunks in order) and, for a subclass, spatial tiles (docs/models.md). Tails of
    ``paths.int8_cache_bytes`` or more are kept in int8 (``vae_paths.PackedTail``); with
    ``paths.cache_offload``, a GPU's are parked in host memory from ``park(n)`` (``n`` codes), each
    fetched back on a side stream while the conv before it runs. ``temporal=False`` carries nothing
    (a subclass that only overrides :meth:`group_norm_stats`)."""

    def __init__(self, temporal: bool = True, paths: VaePaths = TODAY,
                 park: Optional[Callable[[int], object]] = None) -> None:
        self.temporal = temporal
        self.paths = paths
        self.park = park if paths.cache_offload else None
        self._tails: Dict[nn.Module, Union[Tensor, PackedTail]] = {}
        self._parking: Dict[nn.Module, object] = {}  # each parked tail's host memory, reused
        self._ahead: Dict[nn.Module, Tuple[PackedTail, object]] = {}  # (on its way, done event)
        self._streams: Dict[torch.device, object] = {}  # the side stream of each device
        self._seen: set = set()

    def tail(self, module: nn.Module) -> Optional[Union[Tensor, PackedTail]]:
        """The tail kept for ``module`` on its device: a tensor or int8 codes (parked: fetched)."""
        kept = self._tails.get(module)
        if not isinstance(kept, PackedTail) or kept.parked is None:
            return kept
        ready = self._arrived(module) or kept.fetch(module.weight.device)
        self._prefetch_after(module)
        return ready

    def _arrived(self, module: nn.Module) -> Optional[PackedTail]:
        """The tail fetched ahead for ``module`` (None: none), waited for by the compute stream."""
        ahead = self._ahead.pop(module, None)
        if ahead is None:
            return None
        fetched, done = ahead
        compute = torch.cuda.current_stream(fetched.codes.device)
        compute.wait_event(done)
        fetched.codes.record_stream(compute)  # made on the side stream, freed after this use
        return fetched

    def _prefetch_after(self, module: nn.Module) -> None:
        """Start fetching the next parked tail on a side stream, overlapping the conv to run."""
        modules = list(self._tails)
        for following in modules[modules.index(module) + 1:]:
            kept = self._tails[following]
            if isinstance(kept, PackedTail) and kept.parked is not None:
                if following not in self._ahead:
                    device = following.weight.device
                    if device not in self._streams:
                        self._streams[device] = torch.cuda.Stream(device)
                    side = self._streams[device]
                    side.wait_stream(torch.cuda.current_stream(device))  # its packing is done
                    with torch.cuda.stream(side):
                        fetched = kept.fetch(device)
                        done = torch.cuda.Event()
                        done.record(side)
                    self._ahead[following] = (fetched, done)
                return

    def tail_length(self, module: nn.Module) -> Optional[int]:
        kept = self._tails.get(module)
        return None if kept is None else kept.shape[2]

    def set_tail(self, module: nn.Module, frames: Tensor, fresh: bool = False) -> None:
        """Keep ``frames`` for ``module``'s next chunk: a copy, freeing the padded input they
        are sliced from (``fresh``: already their own tensor)."""
        if not self.temporal:
            return
        limit = self.paths.int8_cache_bytes
        self._arrived(module)  # a fetch not used: done before its host memory is rewritten
        if limit is not None and frames.numel() * frames.element_size() >= limit:
            self._tails[module] = PackedTail.pack(frames.detach(), self._parked(module, frames))
        else:
            self._tails[module] = frames.detach() if fresh else frames.detach().clone()

    def _parked(self, module: nn.Module, frames: Tensor):
        """Host memory for ``module``'s parked tail (reused chunk to chunk), else None."""
        if self.park is None or frames.device.type != "cuda":
            return None
        parked = self._parking.get(module)
        if parked is None or parked.views[0].numel() != frames.numel():
            parked = self._parking[module] = self.park(frames.numel())
        return parked

    def first_visit(self, module: nn.Module) -> bool:
        """True while ``module`` processes the first chunk (always, without temporal state)."""
        if not self.temporal:
            return True
        if module in self._seen:
            return False
        self._seen.add(module)
        return True

    # -- frame-wide statistics (overridden by spatial tiling) -------------------------------

    def group_norm_stats(self, norm: "FrameGroupNorm", x: Tensor) -> Tuple[Tensor, Tensor]:
        """Mean, variance ``(B, G, 1, T)`` ``norm`` uses on ``x`` (compute dtype): ``x``'s own."""
        return frame_group_stats(x.flatten(3), norm.num_groups)


class CausalConv3d(nn.Conv3d):
    """A 3-D convolution causal in time (docs/models.md, "Causality"), ``nn.Conv3d``'s weights.
    ``padding`` ``(p_t, p_h, p_w)`` as the official layer: ``2 * p_t`` copies of the first frame
    (with a :class:`CausalCache`, the previous chunk's last frames) prepended; space zero padded by
    ``(p_h, p_w)`` or ``spatial_pad = (left, right, top, bottom)``. Call ``conv(x)``, or fill
    ``buf, body = conv.input_buffer(...)`` and call ``conv.forward_padded(buf)`` (no padding copy).
    ``paths``: the VAE's kernel paths (:func:`conv3d`)."""

    paths: VaePaths = TODAY

    def __init__(self, in_channels: int, out_channels: int, kernel_size: _int3,
                 stride: _int3 = 1, padding: _int3 = 0, bias: bool = True,
                 spatial_pad: Optional[Tuple[int, int, int, int]] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0,
                         bias=bias)
        pad_t, pad_h, pad_w = _triple(padding)
        self.head_frames = 2 * pad_t
        # Frames of the padded input that the next chunk's first window overlaps.
        self.tail_frames = max(self.kernel_size[0] - self.stride[0], 0)
        if spatial_pad is None:
            self.conv_padding = (0, pad_h, pad_w)
            self.spatial_pad = None
        else:
            self.conv_padding = (0, 0, 0)
            self.spatial_pad = tuple(spatial_pad)

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        if self.spatial_pad is not None:
            x = F.pad(x, self.spatial_pad)
        # A cached tail was stored after padding, so it already has the padded spatial size.
        head = cache.tail(self) if cache is not None else None
        if isinstance(head, PackedTail):
            head = head.unpack()
        if head is None and self.head_frames:
            head = x[:, :, :1].expand(-1, -1, self.head_frames, -1, -1)
        if head is not None:
            x = torch.cat([head, x], dim=2)
        return self._conv(x, cache)

    def input_buffer(self, like: Tensor, shape: Sequence[int],
                     cache: Optional[CausalCache] = None) -> Tuple[Tensor, Tensor]:
        """An empty padded input (``like``'s dtype, device) for input ``shape``, and its body."""
        if self.spatial_pad is not None:
            raise NotImplementedError("input_buffer supports symmetric spatial padding only")
        B, C, T, H, W = shape
        n = self.head_length(cache)
        layout = torch.channels_last_3d if self.paths.channels_last else torch.contiguous_format
        buf = torch.empty((B, C, n + T, H, W), dtype=like.dtype, device=like.device,
                          memory_format=layout)
        return buf, buf[:, :, n:]

    def forward_padded(self, buf: Tensor, cache: Optional[CausalCache] = None,
                       residual: Optional[Tensor] = None) -> Tensor:
        """Convolve a filled buffer from :meth:`input_buffer` (plus ``residual``)."""
        n = self.head_length(cache)
        if n:
            tail = cache.tail(self) if cache is not None else None
            copy_tail(buf[:, :, :n], buf[:, :, n:n + 1] if tail is None else tail)
        return self._conv(buf, cache, residual)

    def head_length(self, cache: Optional[CausalCache]) -> int:
        """Frames before the body in the padded input (cached tail or first-frame copies)."""
        cached = cache.tail_length(self) if cache is not None else None
        return self.head_frames if cached is None else cached

    def spec(self) -> ConvSpec:
        return ConvSpec(self.weight, self.bias, self.stride, self.conv_padding, self.paths)

    def _conv(self, padded: Tensor, cache: Optional[CausalCache],
              residual: Optional[Tensor] = None) -> Tensor:
        if cache is not None and self.tail_frames:
            cache.set_tail(self, padded[:, :, padded.shape[2] - self.tail_frames:])
        return conv3d_in_bands(padded, self.spec(), residual=residual)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm with statistics per frame in float32: ``nn.GroupNorm`` over ``(B*T, C, H, W)``
    without transposing copies, one fused ``scale * x + shift`` pass (into ``out`` if given)."""

    def forward(self, x: Tensor, out: Optional[Tensor] = None,
                cache: Optional[CausalCache] = None) -> Tensor:
        """``cache`` may supply the statistics (:meth:`CausalCache.group_norm_stats`)."""
        if x.ndim != 5:
            raise InputError(f"FrameGroupNorm expects (B, C, T, H, W), got shape {tuple(x.shape)}")
        B, C, T = x.shape[:3]
        G = self.num_groups
        compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if (x.dtype != compute_dtype and x.numel() > SPLIT_ELEMENTS
                and not _records_graph(x, self.weight, self.bias)
                and (cache is None or type(cache).group_norm_stats is CausalCache.group_norm_stats)):
            return self._forward_in_channel_groups(x, out, compute_dtype)
        x_c = x.reshape(B, C, T, -1).to(compute_dtype)  # no copy in float32
        if cache is None:
            mean_g, var_g = frame_group_stats(x_c, G)
        else:
            mean_g, var_g = cache.group_norm_stats(self, x_c.view(x.shape))
        scale, shift = self._scale_shift(mean_g, var_g, x.shape, compute_dtype)
        if _records_graph(x, self.weight, self.bias):
            # out= and in-place ops would break the autograd graph: plain ops, then copy.
            y = torch.addcmul(shift, x_c, scale).view(x.shape).to(x.dtype)
            return y if out is None else out.copy_(y)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x_c.dtype == x.dtype:
            torch.addcmul(shift, x_c, scale, out=out.view(B, C, T, -1))
        else:  # x_c is a private upcast copy: normalise it in place, cast while storing
            out.view(B, C, T, -1).copy_(x_c.mul_(scale).add_(shift))
        return out

    def _scale_shift(self, mean_g: Tensor, var_g: Tensor, shape: Sequence[int],
                     dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """``scale`` and ``shift`` ``(B, C, T, 1)`` of the fused ``scale * x + shift``."""
        B, C, T = shape[:3]
        G = self.num_groups
        rstd = torch.rsqrt(var_g + self.eps)
        weight = self.weight.to(dtype).view(1, G, C // G, 1)
        bias = self.bias.to(dtype).view(1, G, C // G, 1)
        return (weight * rstd).reshape(B, C, T, 1), (bias - mean_g * weight * rstd).reshape(B, C, T, 1)

    def _channel_step(self, x_flat: Tensor) -> int:
        """Channels per float32 piece: whole groups, a quarter of the limit (a temporary)."""
        B, C, T, N = x_flat.shape
        per_group = C // self.num_groups
        return max(1, SPLIT_ELEMENTS // 4 // (B * per_group * T * N)) * per_group

    def statistics(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tuple[Tensor, Tensor]:
        """The per-frame mean and variance ``(B, G, 1, T)`` :meth:`forward` normalises ``x`` with
        (``cache``'s when it overrides them), in float32 (float64 input: float64)."""
        B, C, T = x.shape[:3]
        compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if cache is not None and type(cache).group_norm_stats is not CausalCache.group_norm_stats:
            return cache.group_norm_stats(self, x.to(compute_dtype))
        x_flat = x.reshape(B, C, T, -1)
        step = self._channel_step(x_flat)
        moments = [torch.var_mean(x_flat[:, c:c + step].to(compute_dtype), dim=-1, correction=0)
                   for c in range(0, C, step)]
        return group_stats_from_channels(torch.cat([m for _, m in moments], dim=1),
                                         torch.cat([v for v, _ in moments], dim=1), self.num_groups)

    def _forward_in_channel_groups(self, x: Tensor, out: Optional[Tensor],
                                   compute_dtype: torch.dtype) -> Tensor:
        """:meth:`forward` upcasting an input over ``SPLIT_ELEMENTS`` a piece of channel groups
        at a time (no float32 copy of all of ``x``), bit-identical to one piece."""
        B, C, T = x.shape[:3]
        scale, shift = self._scale_shift(*self.statistics(x), x.shape, compute_dtype)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        x_flat, out_flat = x.reshape(B, C, T, -1), out.view(B, C, T, -1)
        step = self._channel_step(x_flat)
        for c in range(0, C, step):
            piece = x_flat[:, c:c + step].to(compute_dtype)
            out_flat[:, c:c + step].copy_(piece.mul_(scale[:, c:c + step]).add_(shift[:, c:c + step]))
            del piece  # one float32 piece alive at a time, not the last one and the next
        return out


def norm_act_conv(norm: FrameGroupNorm, conv: CausalConv3d, x: Tensor,
                  cache: Optional[CausalCache] = None, residual: Optional[Tensor] = None) -> Tensor:
    """``conv(silu(norm(x))) (+ residual)``, the activation written straight into the conv's
    padded input buffer, the residual added band by band (fused into fp16_conv3d)."""
    buf, body = conv.input_buffer(x, x.shape, cache)
    if _records_graph(x, norm.weight, norm.bias):
        body.copy_(silu(norm(x, cache=cache)))
    else:
        norm_silu_into(norm, x, body, cache, conv.paths)
    return conv.forward_padded(buf, cache, residual)


def norm_silu_into(norm: FrameGroupNorm, x: Tensor, out: Tensor,
                   cache: Optional[CausalCache], paths: VaePaths) -> None:
    """``out = silu(norm(x))`` (``out`` may be ``x``; inference only): comfy-kitchen's
    ``group_norm_silu_pad3d`` on the fused path (half precision; in place a frame at a time)."""
    if not (paths.fused_norm and x.dtype in vae_paths.HALF):
        silu(norm(x, out=out, cache=cache), inplace=True)
        return
    mean, var = norm.statistics(x, cache)
    stats = vae_paths.kitchen_stats(mean, var, norm.eps)
    frames = 1 if out is x else None  # in place: a frame's copy at most (fake tensors
    # of a rehearsal have no addresses to compare)
    vae_paths.kitchen_norm_silu_into(norm, x, stats, out, frames)


class ResnetBlock3D(nn.Module):
    """Pre-norm residual block ``x + conv2(silu(norm2(conv1(silu(norm1(x))))))``, causal 3x3x3 convs
    ("full" temporal receptive field); a 1x1x1 ``conv_shortcut`` projects ``x`` to a new width."""

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = FrameGroupNorm(groups, in_channels, eps=NORM_EPS)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, padding=1)
        self.norm2 = FrameGroupNorm(groups, out_channels, eps=NORM_EPS)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, padding=1)
        self.conv_shortcut = (CausalConv3d(in_channels, out_channels, 1)
                              if in_channels != out_channels else None)

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        h = norm_act_conv(self.norm1, self.conv1, x, cache)
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x, cache)
        # Added band by band (fp16: in conv2's epilogue): one addition per element, as afterwards.
        return norm_act_conv(self.norm2, self.conv2, h, cache, residual=shortcut)

    def forward_owned(self, owned: List[Tensor], cache: Optional[CausalCache] = None) -> Tensor:
        """:meth:`forward` on an input inside ``conv1``'s filled padded buffer, popped from the
        one-element list ``owned`` so nothing else keeps it alive. The shortcut reads it, then the
        norm overwrites it in place: one full-size buffer where :meth:`forward` holds two.
        Inference only, with a shortcut (:meth:`takes_owned`)."""
        buf = owned.pop()
        body = buf[:, :, self.conv1.head_length(cache):]
        shortcut = self.conv_shortcut(body, cache)
        norm_silu_into(self.norm1, body, body, cache, self.conv1.paths)
        del body
        h = self.conv1.forward_padded(buf, cache)
        del buf
        return norm_act_conv(self.norm2, self.conv2, h, cache, residual=shortcut)

    def takes_owned(self, x: Tensor) -> bool:
        """Whether :meth:`forward_owned` may run on input ``x`` (a shortcut, no autograd)."""
        return self.conv_shortcut is not None and not _records_graph(x, *self.parameters())


class FrameAttention(nn.Module):
    """Single-head self-attention over each frame's ``H*W`` positions, with residual: ``x +
    to_out(softmax(q k^T / sqrt(C)) v)`` (diffusers' names), in SDPA calls within
    ``ATTENTION_SCORE_BUDGET`` scores (frames in groups, a large frame's queries in blocks)."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = FrameGroupNorm(groups, channels, eps=NORM_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        B, C, T, H, W = x.shape
        # One sequence of H*W tokens per frame: (B*T, H*W, C).
        tokens = self.group_norm(x, cache=cache).permute(0, 2, 3, 4, 1).reshape(B * T, H * W, C)
        q = self.to_q(tokens).unsqueeze(1)  # (B*T, 1 head, H*W, C)
        k = self.to_k(tokens).unsqueeze(1)
        v = self.to_v(tokens).unsqueeze(1)
        del tokens
        N = H * W
        frames_per_call = ATTENTION_SCORE_BUDGET // (N * N)
        if frames_per_call >= B * T:
            out = F.scaled_dot_product_attention(q, k, v)
        else:  # groups of frames, or row blocks of one frame's queries
            out = torch.empty_like(q)
            frames = max(frames_per_call, 1)
            rows = N if frames_per_call else max(ATTENTION_SCORE_BUDGET // N, 1)
            for f0 in range(0, B * T, frames):
                f1 = f0 + frames
                for r0 in range(0, N, rows):
                    out[f0:f1, :, r0:r0 + rows] = F.scaled_dot_product_attention(
                        q[f0:f1, :, r0:r0 + rows], k[f0:f1], v[f0:f1])
        del q, k, v
        out = self.to_out[0](out.squeeze(1))  # (B*T, H*W, C)
        # x first: the sum then takes x's contiguous channels-first layout.
        return x + out.view(B, T, H, W, C).permute(0, 4, 1, 2, 3)


class Downsample3D(nn.Module):
    """Strided causal conv halving H and W (zero pad right/bottom by one, 3x3 stride 2) and,
    when ``temporal``, T (kernel 3 stride 2 after two copies of the first frame: ``2n+1 ->
    n+1``, latent frame 0 sees only input frame 0)."""

    def __init__(self, channels: int, temporal: bool) -> None:
        super().__init__()
        self.conv = CausalConv3d(channels, channels, kernel_size=(3 if temporal else 1, 3, 3),
                                 stride=(2 if temporal else 1, 2, 2),
                                 padding=(1 if temporal else 0, 0, 0), spatial_pad=(0, 1, 0, 1))

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        return self.conv(x, cache)


class Upsample3D(nn.Module):
    """Learned depth-to-space (x2 in H, W and, if ``temporal``, T), then a causal conv:
    ``upscale_conv`` (1x1x1) makes ``r * C`` channels read as ``(x, y, z, c)``; doubled time drops
    frame 0's second copy, ``t -> 2t - 1`` (first chunk only; docs/models.md)."""

    def __init__(self, channels: int, temporal: bool) -> None:
        super().__init__()
        self.channels = channels
        self.time_ratio = 2 if temporal else 1
        self.space_ratio = 2
        ratio = self.time_ratio * self.space_ratio ** 2
        self.upscale_conv = nn.Conv3d(channels, channels * ratio, kernel_size=1)
        self.conv = CausalConv3d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        return self._write(x, cache, self._drops_first_frame(cache))

    def forward_into(self, x: Tensor, following: CausalConv3d,
                     cache: Optional[CausalCache] = None) -> Tensor:
        """The output written into ``following``'s padded input buffer (returned, no head)."""
        drop = self._drops_first_frame(cache)
        B, _, T, H, W = x.shape
        r = self.space_ratio
        buf, body = following.input_buffer(
            x, (B, self.channels, T * self.time_ratio - drop, H * r, W * r), cache)
        self._write(x, cache, drop, body)
        return buf

    def _drops_first_frame(self, cache: Optional[CausalCache]) -> bool:
        # Only the clip's first frame has a duplicate: later chunks keep all 2T frames.
        return self.time_ratio > 1 and (cache is None or cache.first_visit(self))

    def _write(self, x: Tensor, cache: Optional[CausalCache], drop: bool,
               out: Optional[Tensor] = None) -> Tensor:
        """``conv(depth_to_space(upscale_conv(x)))`` (into ``out`` if given) in bands of output
        rows, each band's padded input made from the input rows under it: neither the larger
        ``upscale_conv`` output nor the padded input exists whole (docs/models.md)."""
        conv = self.conv
        B, _, T, H, W = x.shape
        C, r, z = self.channels, self.space_ratio, self.time_ratio
        n = conv.head_length(cache)
        tail = cache.tail(conv) if cache is not None else None
        keep = cache is not None and cache.temporal and conv.tail_frames > 0
        padded = (B, C, n + T * z - drop, H * r, W * r)
        next_tail = x.new_empty(*padded[:2], conv.tail_frames, *padded[3:]) if keep else None

        def band(a: int, b: int) -> Tensor:  # padded input rows [a, b)
            s0, s1 = a // r, -(-b // r)
            y = conv3d(x[:, :, :, s0:s1], self.upscale_conv.weight, self.upscale_conv.bias,
                       paths=conv.paths)
            rows, _ = conv.input_buffer(y, (*padded[:2], padded[2] - n, (s1 - s0) * r, W * r),
                                        cache)
            depth_to_space(y, rows[:, :, n:], (C, r, z), drop)
            del y
            head = rows[:, :, :n]
            if tail is None:
                head.copy_(rows[:, :, n:n + 1])
            else:
                copy_tail(head, tail, (s0 * r, s1 * r))
            if next_tail is not None:
                next_tail[..., s0 * r:s1 * r, :].copy_(rows[:, :, padded[2] - conv.tail_frames:])
            return rows[..., a - s0 * r:b - s0 * r, :]

        row_elements = B * C * (n + T * z) * W * r  # a row of the band or of its upscale
        out = conv_rows(RowSource(band, padded, row_elements), conv.spec(), out=out)
        if keep:
            cache.set_tail(conv, next_tail, fresh=True)
        return out


def depth_to_space(y: Tensor, out: Tensor, ratios: Tuple[int, int, int], drop: bool) -> None:
    """``upscale_conv``'s output ``y`` ``(B, x*y*z*C, T, h, w)`` read as ``(B, x, y, z, C, T, h,
    w)`` into ``out`` ``(B, C, T*z - drop, h*x, w*y)``, skipping ``(t=0, z=1)`` when ``drop``."""
    C, r, z = ratios
    B, _, T, h, w = y.shape
    src = y.view(B, r, r, z, C, T, h, w).permute(0, 4, 5, 3, 6, 1, 7, 2)
    if not drop:
        out.view(B, C, T, z, h, r, w, r).copy_(src)
    else:
        out[:, :, 0].view(B, C, h, r, w, r).copy_(src[:, :, 0, 0])
        out[:, :, 1:].view(B, C, T - 1, z, h, r, w, r).copy_(src[:, :, 1:])


class _Layers(nn.Module):
    """A block run as the sequence of its ``layers()`` (:func:`run_layers`)."""

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        return run_layers(self.layers(), x, cache)


def _resnets(in_channels: int, out_channels: int, num_layers: int, groups: int) -> nn.ModuleList:
    return nn.ModuleList(ResnetBlock3D(in_channels if i == 0 else out_channels, out_channels,
                                       groups) for i in range(num_layers))


class DownEncoderBlock3D(_Layers):
    """``num_layers`` residual blocks, then an optional :class:`Downsample3D`."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int, groups: int,
                 downsample: Optional[str]) -> None:
        super().__init__()
        self.resnets = _resnets(in_channels, out_channels, num_layers, groups)
        self.downsamplers = (nn.ModuleList([Downsample3D(out_channels, downsample == "time")])
                             if downsample else None)

    def layers(self) -> List[nn.Module]:
        return [*self.resnets, *(self.downsamplers or ())]


class UpDecoderBlock3D(_Layers):
    """``num_layers`` residual blocks, then an optional :class:`Upsample3D`."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int, groups: int,
                 upsample: Optional[str]) -> None:
        super().__init__()
        self.resnets = _resnets(in_channels, out_channels, num_layers, groups)
        self.upsamplers = (nn.ModuleList([Upsample3D(out_channels, upsample == "time")])
                           if upsample else None)

    def layers(self) -> List[nn.Module]:
        return [*self.resnets, *(self.upsamplers or ())]


class UNetMidBlock3D(_Layers):
    """Residual block, per-frame self-attention, residual block (at the lowest resolution)."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.resnets = _resnets(channels, channels, 2, groups)
        self.attentions = nn.ModuleList([FrameAttention(channels, groups)])

    def layers(self) -> List[nn.Module]:
        return [self.resnets[0], self.attentions[0], self.resnets[1]]


def run_layers(layers: Sequence[nn.Module], x: Tensor,
               cache: Optional[CausalCache] = None) -> Tensor:
    """Each of ``layers`` (``layer(x, cache)``) on the output of the one before, no input kept
    once its layer is done (a nested ``block(x)`` would hold it through the block). An
    :class:`Upsample3D` before a block with a shortcut writes into that block's padded input
    (:meth:`ResnetBlock3D.forward_owned`; docs/models.md, "Large tensors")."""
    i = 0
    while i < len(layers):
        layer, following = layers[i], layers[i + 1] if i + 1 < len(layers) else None
        if (isinstance(layer, Upsample3D) and isinstance(following, ResnetBlock3D)
                and following.takes_owned(x) and not _records_graph(x, *layer.parameters())):
            owned = [layer.forward_into(x, following.conv1, cache)]
            del x  # the up-sampler's input, not needed past here
            x = following.forward_owned(owned, cache)
            i += 2
        else:
            x = layer(x, cache)
            i += 1
    return x


def down_kinds(num_blocks: int, temporal_scale_num: int) -> Sequence[Optional[str]]:
    """Down-sampling of each encoder block: ``"time"`` (space and time), ``"space"`` or None: none
    in the last, time in the ``temporal_scale_num`` before (released: space, time, time, none)."""
    first_temporal = num_blocks - 1 - temporal_scale_num
    return [None if i == num_blocks - 1 else "time" if i >= first_temporal else "space"
            for i in range(num_blocks)]


def up_kinds(num_blocks: int, temporal_scale_num: int) -> Sequence[Optional[str]]:
    """Up-sampling of each decoder block, mirroring :func:`down_kinds`."""
    return list(reversed(down_kinds(num_blocks, temporal_scale_num)))[1:] + [None]
