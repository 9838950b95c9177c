"""Building blocks of the causal video VAE on ``(B, C, T, H, W)`` tensors (see ``vae.py``).

Convolutions never look ahead (:class:`CausalConv3d`) and everything else acts per frame
(:class:`FrameGroupNorm`, :class:`FrameAttention`); a :class:`CausalCache` carries state
between temporal chunks and hands spatial tiles whole-frame norm statistics. Names follow the
official checkpoint, so a released state dict loads strictly. See docs/models.md.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
    """Whether autograd records ops on ``tensors``; the write-in-place fast paths (``out=``,
    in-place activations) are taken only when it does not (inference, ``no_grad``)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _triple(value: _int3) -> Tuple[int, int, int]:
    return (value,) * 3 if isinstance(value, int) else tuple(value)


def conv3d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: _int3 = 1,
           padding: _int3 = 0, channels_last: bool = False) -> Tensor:
    """``F.conv3d``; ``channels_last`` runs it on channels-last (NDHWC) input and weight (the
    layout cuDNN's tensor-core kernels work in; channels-first inputs may be transposed inside
    cuDNN) and returns the result channels-first again: everything around the convolutions
    (views, in-place writes into padded buffers) stays in the one layout it is written for.
    Whether the two copies this costs pay off is what ``bench/gpu_checks.sh`` measures."""
    if not channels_last:
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
    """A 1x1x1 convolution as one matrix product over the channels. On the CPU, oneDNN's
    1x1x1 kernel splits the channel sum by the thread count, so 1 and 2 threads (one process
    versus two ranks of one thread each) differ in the last bit; the matrix product sums each
    output in the same order at any thread count (tests/test_determinism.py)."""
    B, C, T, H, W = x.shape
    out = torch.matmul(weight.reshape(weight.shape[0], C), x.reshape(B, C, T * H * W))
    if bias is not None:
        out = out + bias.view(1, -1, 1)
    return out.view(B, -1, T, H, W)


def conv3d_in_bands(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: _int3 = 1,
                    padding: _int3 = 0, limit: Optional[int] = None,
                    channels_last: bool = False) -> Tensor:
    """``F.conv3d(x, weight, bias, stride, padding)``, as several calls on bands of output rows
    when the input or output has more than ``limit`` (default :data:`SPLIT_ELEMENTS`) elements;
    each band reads exactly its input rows and halo, so every output element is the same sum
    (docs/models.md, "Large tensors"). ``channels_last``: see :func:`conv3d`.
    """
    limit = SPLIT_ELEMENTS if limit is None else limit
    stride, padding = _triple(stride), _triple(padding)
    B, C, T, H, W = x.shape
    O, _, kt, kh, kw = weight.shape
    out_t, out_h, out_w = ((n + 2 * p - k) // s + 1 for n, p, k, s in
                           zip((T, H, W), padding, (kt, kh, kw), stride))
    out_row = B * O * out_t * out_w
    in_row = B * C * T * W
    if max(x.numel(), out_row * out_h) <= limit:
        return conv3d(x, weight, bias, stride, padding, channels_last)
    rows = max(1, min(limit // out_row, (limit // in_row - kh) // stride[1] + 1))
    out = x.new_empty(B, O, out_t, out_h, out_w)
    band_padding = (padding[0], 0, padding[2])
    for o0 in range(0, out_h, rows):
        o1 = min(o0 + rows, out_h)
        lo = o0 * stride[1] - padding[1]
        hi = (o1 - 1) * stride[1] - padding[1] + kh
        band = x[:, :, :, max(lo, 0):min(hi, H)]
        if lo < 0 or hi > H:
            band = F.pad(band, (0, 0, max(-lo, 0), max(hi - H, 0)))
        out[:, :, :, o0:o1] = conv3d(band, weight, bias, stride, band_padding, channels_last)
    return out


def frame_group_stats(x: Tensor, groups: int) -> Tuple[Tensor, Tensor]:
    """Per-frame GroupNorm statistics of ``x`` ``(B, C, T, N)``: mean and (biased) variance of
    each (sample, group, frame), each ``(B, groups, 1, T)``, in ``x``'s dtype.

    Per-(channel, frame) moments are reduced over the contiguous ``N`` axis and combined
    exactly into group moments (:func:`group_stats_from_channels`)."""
    var_c, mean_c = torch.var_mean(x, dim=-1, correction=0)  # (B, C, T) per plane
    return group_stats_from_channels(mean_c, var_c, groups)


def group_stats_from_channels(mean_c: Tensor, var_c: Tensor,
                              groups: int) -> Tuple[Tensor, Tensor]:
    """Group mean and variance ``(B, G, 1, T)`` from per-channel ones ``(B, C, T)`` over equal
    sample counts (law of total variance)."""
    B, C, T = mean_c.shape
    mean_c = mean_c.view(B, groups, C // groups, T)
    var_c = var_c.view(B, groups, C // groups, T)
    mean_g = mean_c.mean(dim=2, keepdim=True)  # (B, G, 1, T)
    var_g = var_c.mean(dim=2, keepdim=True) + (mean_c - mean_g).square().mean(dim=2,
                                                                               keepdim=True)
    return mean_g, var_g


class CausalCache:
    """State carried between the pieces of one clip: consecutive temporal chunks and, for a
    subclass, spatial tiles (docs/models.md, "Temporal chunks and the cache").

    One fresh cache per clip and direction, chunks in order (``1 + 4k`` frames first when
    encoding, then multiples of 4). ``temporal=False`` carries nothing between calls: for
    subclasses that only override :meth:`group_norm_stats`.
    """

    def __init__(self, temporal: bool = True) -> None:
        self.temporal = temporal
        self._tails: Dict[nn.Module, Tensor] = {}
        self._seen: set = set()

    def tail(self, module: nn.Module) -> Optional[Tensor]:
        return self._tails.get(module)

    def set_tail(self, module: nn.Module, frames: Tensor) -> None:
        if self.temporal:
            # A copy, so that the (much larger) padded input it is sliced from can be freed.
            self._tails[module] = frames.detach().clone()

    def first_visit(self, module: nn.Module) -> bool:
        """True the first time ``module`` asks, i.e. while it processes the first chunk
        (always, without temporal state)."""
        if not self.temporal:
            return True
        if module in self._seen:
            return False
        self._seen.add(module)
        return True

    # -- frame-wide statistics (overridden by spatial tiling) -------------------------------

    def group_norm_stats(self, norm: "FrameGroupNorm", x: Tensor) -> Tuple[Tensor, Tensor]:
        """The per-frame statistics ``norm`` normalises ``x`` with.

        ``x``: the norm's input in its compute dtype, ``(B, C, T, H, W)``. Returns mean and
        variance ``(B, G, 1, T)`` in that dtype; by default those of ``x`` itself."""
        return frame_group_stats(x.flatten(3), norm.num_groups)


class CausalConv3d(nn.Conv3d):
    """A 3-D convolution that is causal in time (docs/models.md, "Causality").

    ``padding`` ``(p_t, p_h, p_w)`` as the official layer: ``2 * p_t`` copies of the first frame
    (or, with a :class:`CausalCache`, the previous chunk's last frames) are prepended; space is
    zero padded by ``(p_h, p_w)`` or an explicit ``spatial_pad = (left, right, top, bottom)``.
    Call ``conv(x)``, or write the input into ``buf, body = conv.input_buffer(...)`` and call
    ``conv.forward_padded(buf)`` to save the padding copy. Parameters are ``nn.Conv3d``'s
    ``weight`` ``(out, in, kt, kh, kw)`` and ``bias``; ``channels_last``: see :func:`conv3d`.
    """

    channels_last = False

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
        if head is None and self.head_frames:
            head = x[:, :, :1].expand(-1, -1, self.head_frames, -1, -1)
        if head is not None:
            x = torch.cat([head, x], dim=2)
        return self._conv(x, cache)

    def input_buffer(self, like: Tensor, shape: Sequence[int],
                     cache: Optional[CausalCache] = None) -> Tuple[Tensor, Tensor]:
        """An uninitialised padded input for an unpadded input of ``shape`` (B, C, T, H, W),
        and the view of it where that input goes. Same dtype/device as ``like``."""
        if self.spatial_pad is not None:
            raise NotImplementedError("input_buffer supports symmetric spatial padding only")
        B, C, T, H, W = shape
        n = self._head_length(cache)
        buf = like.new_empty(B, C, n + T, H, W)
        return buf, buf[:, :, n:]

    def forward_padded(self, buf: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        """Convolve a buffer from :meth:`input_buffer` whose body has been filled."""
        n = self._head_length(cache)
        if n:
            tail = cache.tail(self) if cache is not None else None
            buf[:, :, :n].copy_(buf[:, :, n:n + 1] if tail is None else tail)
        return self._conv(buf, cache)

    def _head_length(self, cache: Optional[CausalCache]) -> int:
        tail = cache.tail(self) if cache is not None else None
        return self.head_frames if tail is None else tail.shape[2]

    def _conv(self, padded: Tensor, cache: Optional[CausalCache]) -> Tensor:
        if cache is not None and self.tail_frames:
            cache.set_tail(self, padded[:, :, padded.shape[2] - self.tail_frames:])
        return conv3d_in_bands(padded, self.weight, self.bias, self.stride, self.conv_padding,
                               channels_last=self.channels_last)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm with statistics per frame, in float32 whatever the model dtype: ``nn.GroupNorm``
    over ``(B*T, C, H, W)`` without the transposing copies, as one fused ``scale * x + shift``
    pass written to ``out`` when given (docs/models.md, "Causality").
    """

    def forward(self, x: Tensor, out: Optional[Tensor] = None,
                cache: Optional[CausalCache] = None) -> Tensor:
        """``cache`` may supply the statistics (:meth:`CausalCache.group_norm_stats`)."""
        if x.ndim != 5:
            raise ValueError(f"FrameGroupNorm expects (B, C, T, H, W), got shape {tuple(x.shape)}")
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
        rstd = torch.rsqrt(var_g + self.eps)

        weight = self.weight.to(compute_dtype).view(1, G, C // G, 1)
        bias = self.bias.to(compute_dtype).view(1, G, C // G, 1)
        scale = (weight * rstd).reshape(B, C, T, 1)
        shift = (bias - mean_g * weight * rstd).reshape(B, C, T, 1)
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

    def _forward_in_channel_groups(self, x: Tensor, out: Optional[Tensor],
                                   compute_dtype: torch.dtype) -> Tensor:
        """The upcasting path of :meth:`forward` for inputs over ``SPLIT_ELEMENTS``: whole groups
        of channels at a time, so no float32 copy of all of ``x`` exists; bit-identical to one
        piece (the same per-channel moments and the same multiply and add per element).
        """
        B, C, T = x.shape[:3]
        G = self.num_groups
        per_group = C // G
        x_flat = x.reshape(B, C, T, -1)
        plane_elements = x_flat.shape[0] * per_group * T * x_flat.shape[-1]
        step = max(1, SPLIT_ELEMENTS // plane_elements) * per_group  # whole groups per piece
        moments = [torch.var_mean(x_flat[:, c:c + step].to(compute_dtype), dim=-1, correction=0)
                   for c in range(0, C, step)]
        var_c = torch.cat([v for v, _ in moments], dim=1)
        mean_c = torch.cat([m for _, m in moments], dim=1)
        mean_g, var_g = group_stats_from_channels(mean_c, var_c, G)
        rstd = torch.rsqrt(var_g + self.eps)
        weight = self.weight.to(compute_dtype).view(1, G, per_group, 1)
        bias = self.bias.to(compute_dtype).view(1, G, per_group, 1)
        scale = (weight * rstd).reshape(B, C, T, 1)
        shift = (bias - mean_g * weight * rstd).reshape(B, C, T, 1)
        if out is None:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out_flat = out.view(B, C, T, -1)
        for c in range(0, C, step):
            piece = x_flat[:, c:c + step].to(compute_dtype)
            out_flat[:, c:c + step].copy_(piece.mul_(scale[:, c:c + step]).add_(shift[:, c:c + step]))
        return out


def norm_act_conv(norm: FrameGroupNorm, conv: CausalConv3d, x: Tensor,
                  cache: Optional[CausalCache] = None) -> Tensor:
    """``conv(silu(norm(x)))`` with the activation written straight into the conv's padded
    input buffer (the pattern of every conv inside the residual blocks and before conv_out)."""
    buf, body = conv.input_buffer(x, x.shape, cache)
    if _records_graph(x, norm.weight, norm.bias):
        body.copy_(F.silu(norm(x, cache=cache)))
    else:
        F.silu(norm(x, out=body, cache=cache), inplace=True)
    return conv.forward_padded(buf, cache)


class ResnetBlock3D(nn.Module):
    """Pre-norm residual block: ``x + conv2(silu(norm2(conv1(silu(norm1(x))))))``.

    Both convolutions are causal 3x3x3 (the released config uses the "full" temporal
    receptive field). A causal 1x1x1 ``conv_shortcut`` projects ``x`` when the channel count
    changes.
    """

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
        h = norm_act_conv(self.norm2, self.conv2, h, cache)
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x, cache)
        return h.add_(shortcut)  # h is conv2's fresh output


class FrameAttention(nn.Module):
    """Single-head self-attention over the ``H*W`` positions of each frame, with residual:
    ``x + to_out(softmax(q k^T / sqrt(C)) v)`` (diffusers' ``Attention`` names). Score matrices
    stay within ``ATTENTION_SCORE_BUDGET`` elements per SDPA call (frames in groups, a large
    frame's queries in row blocks); a cache reaches the norm.
    """

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
    """Strided causal conv halving H and W, and T too when ``temporal``.

    Space: zero pad right/bottom by one, then 3x3 stride 2 without padding (H -> H/2).
    Time (if ``temporal``): kernel 3, stride 2 after prepending two copies of the first frame,
    so ``T = 2n+1 -> n+1`` and latent frame 0 sees only input frame 0.
    """

    def __init__(self, channels: int, temporal: bool) -> None:
        super().__init__()
        self.conv = CausalConv3d(
            channels, channels,
            kernel_size=(3 if temporal else 1, 3, 3),
            stride=(2 if temporal else 1, 2, 2),
            padding=(1 if temporal else 0, 0, 0),
            spatial_pad=(0, 1, 0, 1))

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        return self.conv(x, cache)


class Upsample3D(nn.Module):
    """Learned depth-to-space up-sampling (x2 in H, W and, if ``temporal``, in T), then a causal
    conv: ``upscale_conv`` (1x1x1) makes ``r * C`` channels read as ``(x, y, z, c)``; doubled
    time drops latent frame 0's second copy, ``t -> 2t - 1`` (first chunk only). See
    docs/models.md, "The causal video VAE".
    """

    def __init__(self, channels: int, temporal: bool) -> None:
        super().__init__()
        self.channels = channels
        self.time_ratio = 2 if temporal else 1
        self.space_ratio = 2
        ratio = self.time_ratio * self.space_ratio ** 2
        self.upscale_conv = nn.Conv3d(channels, channels * ratio, kernel_size=1)
        self.conv = CausalConv3d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        # (B, r*C, T, H, W): r times the input, so the output is what may need bands.
        y = conv3d_in_bands(x, self.upscale_conv.weight, self.upscale_conv.bias,
                            channels_last=self.conv.channels_last)
        B, _, T, H, W = y.shape
        C, r, z = self.channels, self.space_ratio, self.time_ratio
        # Only the clip's first frame has a duplicate: later chunks keep all 2T frames.
        drop = z > 1 and (cache is None or cache.first_visit(self))
        # Depth-to-space straight into the conv's padded input: (B, x, y, z, C, T, H, W) ->
        # (B, C, T, z, H, x, W, y), skipping (t=0, z=1) instead of cutting it out afterwards.
        src = y.view(B, r, r, z, C, T, H, W).permute(0, 4, 5, 3, 6, 1, 7, 2)
        buf, out = self.conv.input_buffer(y, (B, C, T * z - drop, H * r, W * r), cache)
        if not drop:
            out.view(B, C, T, z, H, r, W, r).copy_(src)
        else:
            out[:, :, 0].view(B, C, H, r, W, r).copy_(src[:, :, 0, 0])
            out[:, :, 1:].view(B, C, T - 1, z, H, r, W, r).copy_(src[:, :, 1:])
        del y, src
        return self.conv.forward_padded(buf, cache)


class DownEncoderBlock3D(nn.Module):
    """``num_layers`` residual blocks, then an optional :class:`Downsample3D`."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int, groups: int,
                 downsample: Optional[str]) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock3D(in_channels if i == 0 else out_channels, out_channels, groups)
            for i in range(num_layers))
        self.downsamplers = (nn.ModuleList([Downsample3D(out_channels, downsample == "time")])
                             if downsample else None)

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x, cache)
        return x


class UpDecoderBlock3D(nn.Module):
    """``num_layers`` residual blocks, then an optional :class:`Upsample3D`."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int, groups: int,
                 upsample: Optional[str]) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock3D(in_channels if i == 0 else out_channels, out_channels, groups)
            for i in range(num_layers))
        self.upsamplers = (nn.ModuleList([Upsample3D(out_channels, upsample == "time")])
                           if upsample else None)

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, cache)
        return x


class UNetMidBlock3D(nn.Module):
    """Residual block, per-frame self-attention, residual block (at the lowest resolution)."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock3D(channels, channels, groups),
                                      ResnetBlock3D(channels, channels, groups)])
        self.attentions = nn.ModuleList([FrameAttention(channels, groups)])

    def forward(self, x: Tensor, cache: Optional[CausalCache] = None) -> Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x, cache)
        return self.resnets[1](x, cache)


def down_kinds(num_blocks: int, temporal_scale_num: int) -> Sequence[Optional[str]]:
    """Down-sampling of each encoder block: ``"time"`` (space and time), ``"space"`` or None.

    The last block never down-samples; the ``temporal_scale_num`` blocks before it also halve
    time, the earlier ones only space (released model: space, time, time, none).
    """
    first_temporal = num_blocks - 1 - temporal_scale_num
    return [None if i == num_blocks - 1 else "time" if i >= first_temporal else "space"
            for i in range(num_blocks)]


def up_kinds(num_blocks: int, temporal_scale_num: int) -> Sequence[Optional[str]]:
    """Up-sampling of each decoder block, mirroring :func:`down_kinds`
    (released model: time, time, space, none)."""
    return list(reversed(down_kinds(num_blocks, temporal_scale_num)))[1:] + [None]
