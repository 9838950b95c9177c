"""Which kernels the causal VAE runs on (issue #36), chosen once per VAE and device.

Today's path is plain torch: channels-first buffers, ``FrameGroupNorm`` in float32 pieces,
then SiLU, cuDNN convolutions, causal caches in the model dtype. Four others, each falling back
to today's where comfy-kitchen or the GPU's capability is missing (``seedvr2.kernels`` quotes
their preconditions; the log says once which path runs):

* ``channels_last``: NDHWC padded input buffers (bands are views), read without conversion;
* ``fused_norm``: norm -> SiLU -> padded buffer in one ``group_norm_silu_pad3d`` pass;
* ``fp16_accumulation`` (fp16 models): ``fp16_conv3d``, the resnet shortcut fused into conv2;
* ``int8_cache_bytes``: causal tails from this size on in int8 with one float32 scale (as
  ComfyUI's ``TensorWiseINT8Layout``), optionally parked in pinned host memory.

Requirements, costs and error bounds: docs/memory.md, "VAE kernel paths"."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import kernels

log = logging.getLogger("seedvr2")

NORM_KERNEL = "comfy_kitchen.group_norm_silu_pad3d"
CONV_KERNEL = "comfy_kitchen.fp16_conv3d"
# Causal tails from this size on are packed to int8 when the int8 cache is asked for: the
# full-resolution levels' tails (1080p: 256 channels x 2 frames is 2 GiB in fp16), not the
# small ones, where the scale's cost and the rounding would buy nothing (ComfyUI: 64 MiB).
INT8_CACHE_BYTES = 64 << 20
VIEW_ELEMENTS = 1 << 30  # largest input view (elements) of one fused-kernel call (why: kernels.py)
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VaePaths:
    """The VAE's kernel paths; the default is today's. See the module doc."""

    channels_last: bool = False
    fused_norm: bool = False
    fp16_accumulation: bool = False
    int8_cache_bytes: Optional[int] = None
    cache_offload: bool = False  # int8 tails in (pinned) host memory, prefetched

    def describe(self) -> str:
        parts = [("channels-last padded buffers" if self.channels_last
                  else "channels-first buffers"),
                 ("comfy-kitchen group_norm_silu_pad3d" if self.fused_norm
                  else "FrameGroupNorm then SiLU"),
                 ("comfy-kitchen fp16_conv3d (fp16 accumulation)" if self.fp16_accumulation
                  else "torch conv3d")]
        if self.int8_cache_bytes is not None:
            size = self.int8_cache_bytes
            size = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size} bytes"
            parts.append(f"int8 causal tails from {size}"
                         + (" in host memory" if self.cache_offload else ""))
        return ", ".join(parts)


TODAY = VaePaths()


def choose_paths(device, dtype: torch.dtype, *, channels_last: bool = False,
                 fp16_accumulation: bool = False, int8_cache_bytes: Optional[int] = None,
                 cache_offload: bool = False) -> VaePaths:
    """The paths a VAE of ``dtype`` on ``device`` runs: the fused norm wherever comfy-kitchen
    runs it, fp16 accumulation where asked for and possible (else logged with why)."""
    platform = kernels.platform_of(torch.device(device))

    def usable(kernel: str, wanted_dtypes) -> Optional[str]:
        if dtype not in wanted_dtypes:
            return f"the VAE runs in {str(dtype).removeprefix('torch.')}"
        if not kernels.kitchen_installed():
            return "comfy-kitchen is not installed (pip install seedvr2-comfyui[kitchen])"
        if platform.kind == "cuda":  # its eager stand-in would copy whole activations
            if not kernels.kitchen_cuda_backend_allowed(platform.torch_cuda):
                return "comfy-kitchen's CUDA kernels need a torch built for CUDA 13 or newer"
            missing = kernels.kitchen_cuda_missing()
            if missing:
                return f"comfy-kitchen's CUDA backend did not load ({missing})"
        return kernels.runs_on([kernel], platform)

    fused = usable(NORM_KERNEL, HALF) is None
    fp16 = False
    if fp16_accumulation:
        why = usable(CONV_KERNEL, (torch.float16,))
        fp16 = why is None
        if why:
            log.warning("vae_fp16_accumulation: %s; the VAE's convolutions run as without it", why)
    paths = VaePaths(bool(channels_last), fused, fp16, int8_cache_bytes,
                     bool(cache_offload) and int8_cache_bytes is not None)
    log.info("VAE paths on %s: %s", platform.describe(), paths.describe())
    return paths


# -- the fused norm ---------------------------------------------------------------------------

def kitchen_stats(mean: Tensor, var: Tensor, eps: float) -> Tensor:
    """``FrameGroupNorm`` statistics ``(B, G, 1, T)`` as comfy-kitchen's ``stats``: float32
    ``[B*T, G, 2]`` of ``(mean, rstd)``, rows frame-major within each sample."""
    B, G, _, T = mean.shape
    pair = torch.stack((mean.float(), torch.rsqrt(var.float() + eps)), dim=-1)  # (B,G,1,T,2)
    return pair.view(B, G, T, 2).permute(0, 2, 1, 3).reshape(B * T, G, 2)


def kitchen_norm_silu_into(norm: torch.nn.GroupNorm, x: Tensor, stats: Tensor, out: Tensor,
                           frames: Optional[int] = None) -> None:
    """``out = silu(norm(x))`` through ``group_norm_silu_pad3d`` with per-frame ``stats``
    (:func:`kitchen_stats`), ``frames`` at a time (default: within :data:`VIEW_ELEMENTS`);
    ``out`` is ``x``-shaped (a padded buffer's body: the kernel's padding would zero the head)."""
    ck = kernels.kitchen()
    B, C, T = x.shape[:3]
    per_frame = x[:, :, :1].numel()
    step = frames or max(1, (VIEW_ELEMENTS - 1) // per_frame)
    groups = norm.num_groups
    rows = stats.view(B, T, groups, 2)
    for t0 in range(0, T, step):
        t1 = min(t0 + step, T)
        ck.group_norm_silu_pad3d(x[:, :, t0:t1], norm.weight, norm.bias, groups, norm.eps,
                                 (0, 0, 0, 0, 0), True, True, out=out[:, :, t0:t1],
                                 stats=rows[:, t0:t1].reshape(B * (t1 - t0), groups, 2))


# -- fp16 accumulation ------------------------------------------------------------------------

def fp16_conv3d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride, pad,
                residual: Optional[Tensor] = None) -> Tensor:
    """``conv3d(x zero-padded by pad, weight, bias, stride) (+ residual)`` through
    comfy-kitchen's ``fp16_conv3d``, which pads nothing itself; ``pad`` in ``F.pad``'s order
    ``(left, right, top, bottom, front, back)``. Channels-first out."""
    if any(pad):
        x = torch.nn.functional.pad(x, pad)
    stride = [stride] * 3 if isinstance(stride, int) else list(stride)
    return kernels.kitchen().fp16_conv3d(x, weight, bias, residual, stride).contiguous()


# -- int8 causal tails ------------------------------------------------------------------------

# Tails are packed and unpacked a piece at a time (rows of one frame), so the float32 values
# in between are at most this many elements (64 MiB), not two float32 copies of the tail.
PIECE_ELEMENTS = 1 << 24


def _pieces(shape: torch.Size):
    """``(frame, first row, end row, offset)`` of each piece of a ``(B, C, T, H, W)`` tail:
    rows of one frame, kept one after another in the flat codes."""
    B, C, T, H, W = shape
    rows = max(1, min(H, PIECE_ELEMENTS // max(1, B * C * W)))
    offset = 0
    for frame in range(T):
        for h0 in range(0, H, rows):
            h1 = min(h0 + rows, H)
            yield frame, h0, h1, offset
            offset += B * C * (h1 - h0) * W


@dataclass(frozen=True)
class PackedTail:
    """A causal tail ``(B, C, T, H, W)`` of ``dtype`` in int8 with one float32 scale
    (``absmax / 127``): ``codes`` flat, piece after piece (:func:`_pieces`), on the tail's device
    or ``parked`` in a ``memory.arena.HostArena`` (``views[0]``; ``copy_into(0, out)`` uploads)."""

    codes: Tensor
    scale: Tensor
    dtype: torch.dtype
    shape: torch.Size
    parked: object = None

    @staticmethod
    def pack(frames: Tensor, parked=None) -> "PackedTail":
        """``frames`` in int8: ``parked``'s codes (asynchronously), else new ones on its device."""
        low, high = torch.aminmax(frames)  # one reduction, no |frames| made
        scale = torch.maximum(-low.float(), high.float())
        scale = scale.clamp_min(torch.finfo(torch.float32).tiny) / 127
        codes = parked.views[0] if parked is not None else \
            torch.empty(frames.numel(), dtype=torch.int8, device=frames.device)
        for frame, h0, h1, offset in _pieces(frames.shape):
            piece = frames[:, :, frame, h0:h1].to(torch.float32, copy=True)
            piece.div_(scale).round_().clamp_(-127, 127)
            codes[offset:offset + piece.numel()].view(piece.shape).copy_(piece, non_blocking=True)
            del piece  # before the next is made
        return PackedTail(codes, scale, frames.dtype, frames.shape, parked)

    def fetch(self, device: torch.device) -> "PackedTail":
        """The codes on ``device``, copied on the current stream (asynchronously if pinned)."""
        if self.parked is None:
            return self
        codes = torch.empty(self.codes.shape, dtype=torch.int8, device=device)
        self.parked.copy_into(0, codes)
        return PackedTail(codes, self.scale, self.dtype, self.shape)

    def unpack_into(self, out: Tensor, rows: Optional[Tuple[int, int]] = None) -> None:
        """Write the values (rows ``[a, b)`` of every frame; all) into ``out``, piece by piece."""
        B, C, _, H, W = self.shape
        a, b = rows or (0, H)
        for frame, h0, h1, offset in _pieces(self.shape):
            lo, hi = max(h0, a), min(h1, b)
            if lo < hi:
                codes = self.codes[offset:offset + B * C * (h1 - h0) * W].view(B, C, h1 - h0, W)
                out[:, :, frame, lo - a:hi - a].copy_(
                    codes[:, :, lo - h0:hi - h0].float().mul_(self.scale))

    def unpack(self) -> Tensor:
        values = torch.empty(self.shape, dtype=self.dtype, device=self.codes.device)
        self.unpack_into(values)
        return values


def copy_tail(out: Tensor, tail, rows: Optional[Tuple[int, int]] = None) -> None:
    """``out`` = a kept causal tail (tensor or device :class:`PackedTail`), rows ``[a, b)``."""
    if isinstance(tail, PackedTail):
        tail.unpack_into(out, rows)
    else:
        out.copy_(tail if rows is None else tail[..., rows[0]:rows[1], :])
