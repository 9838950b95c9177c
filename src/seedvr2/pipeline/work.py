"""The work of a job before it runs (FLOPs and bytes per phase) and its time on the device.

:class:`OpCounter` counts every operation it sees: FLOPs by torch's formulas (the fused attention by
``sdpa_flop_count``, comfy-kitchen's ``fp16_conv3d`` as a convolution) and bytes moved as if nothing
were fused. ``bench/roofline.py`` runs it at real size on fake tensors; a job's estimate
(:func:`job_work`) runs the models on ``meta`` tensors at a small size and scales: the VAE's work
per output pixel and frame (its attention, a few % at 1080p, at that size's share), the DiT's per
video token plus its windowed attention. :func:`device_rates` probes the device for about a second
(cached); :meth:`JobWork.seconds` is the counted work at the probe's best and worst rates."""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from ..memory.budget import TEXT_TOKENS
from ..memory.tiling import settings_from_options, tile_layout
from ..models import build_on_meta
from ..models.window import make_windows
from .runner import MODEL_MULTIPLE

log = logging.getLogger(__name__)

_CONV_OPS = {"convolution", "_convolution", "cudnn_convolution", "fp16_conv3d"}
_LINEAR_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
_NORM_OPS = {"native_group_norm", "native_layer_norm", "var_mean", "rsqrt", "_fused_rms_norm",
             "rms_norm", "group_norm_silu_pad3d"}
_FREE_OPS = {"empty", "empty_like", "empty_strided", "detach", "_local_scalar_dense", "lift_fresh"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _conv_flops(x, weight, *args, out_val=None, **kwargs) -> int:
    """A convolution outside torch's registry (comfy-kitchen's): 2 FLOPs per multiply-add."""
    return 2 * out_val.numel() * weight[0].numel()


class OpCounter(TorchDispatchMode):
    """Counts ``ops[(phase, op class, flops, bytes)]``: classes ``conv3d <width>``, ``linear``,
    ``attention``, ``norms`` (ops inside a ``*Norm`` module too), ``elementwise``. Set ``phase``
    as the work goes; :meth:`attention` wraps the attention call so its kernel counts as one."""

    def __init__(self):
        super().__init__()
        self.phase, self.ops, self._norms, self._quiet, self._hooks = "", Counter(), 0, False, []

    def __enter__(self):
        def enter(module, *_):
            self._norms += "Norm" in type(module).__name__

        def leave(module, *_):
            self._norms -= "Norm" in type(module).__name__
        hooks = torch.nn.modules.module
        self._hooks = [hooks.register_module_forward_pre_hook(enter),
                       hooks.register_module_forward_hook(leave)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def add(self, cls: str, flops: int, nbytes: int, times: int = 1):
        self.ops[(self.phase, cls, int(flops), int(nbytes))] += times

    def attention(self, kernel: Callable) -> Callable:
        """``kernel`` (an ``F.scaled_dot_product_attention``) counted as the fused kernel:
        its FLOPs, q, k and v read and the output written once."""
        def attend(q, k, v, *args, **kwargs):
            self._quiet = True
            try:
                out = kernel(q, k, v, *args, **kwargs)
            finally:
                self._quiet = False
            self.add("attention", sdpa_flop_count(q.shape, k.shape, v.shape),
                     sum(map(_nbytes, (q, k, v, out))))
            return out
        return attend

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name, returns = func._overloadpacket.__name__, func._schema.returns
        if self._quiet or name in _FREE_OPS or (
                returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write):
            return out  # inside a counted kernel, a view or an allocation: no data moves
        formula = flop_registry.get(func._overloadpacket) or (_conv_flops if name in _CONV_OPS
                                                              else None)
        cls = f"conv3d {args[1].shape[0]}" if name in _CONV_OPS else "linear" \
            if name in _LINEAR_OPS else "norms" if name in _NORM_OPS or self._norms else \
            "elementwise"
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.add(cls, formula(*args, **kwargs, out_val=out) if formula else 0,
                 sum(map(_nbytes, tensors)))
        return out


@dataclass(frozen=True)
class Rates:
    """What a device does at most: matrix-product and convolution FLOP/s, memory bytes/s."""

    matmul: float
    conv: float
    bandwidth: float

    def seconds(self, cls: str, flops: float, nbytes: float) -> float:
        """One op at these rates: bound by its arithmetic or by its memory traffic."""
        rate = self.conv if cls.startswith("conv") else self.matmul
        return max(flops / rate, nbytes / self.bandwidth)


def _rounds(fn: Callable, sync: Callable, seconds: float) -> list[float]:
    fn()
    sync()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


@functools.lru_cache(maxsize=None)
def device_rates(device: str, dtype: torch.dtype) -> tuple[Rates, Rates]:
    """(best, worst) rates of ``device`` in ``dtype`` over about a second of short rounds,
    cached for the process: a square matrix product; a 3x3x3 convolution as the VAE convolves
    (padded causally beforehand, none inside: oneDNN picks a slow kernel for some padded
    small shapes, at half the VAE's rate); a copy larger than the caches (a copy that fits in a
    CPU's cache runs several times faster than the full-size planes the VAE streams)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n, c, hw = (4096, 256, (64, 64)) if dev.type == "cuda" else (512, 128, (32, 48))
    a = torch.randn(n, n, device=dev, dtype=dtype)
    x = F.pad(torch.randn(1, c, 5, *hw, device=dev, dtype=dtype), (1, 1, 1, 1, 2, 0))
    w = torch.randn(c, c, 3, 3, 3, device=dev, dtype=dtype)
    src = torch.empty((256 if dev.type == "cuda" else 128) << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    with torch.no_grad():
        mm = _rounds(lambda: a @ a, sync, 0.3)
        conv = _rounds(lambda: F.conv3d(x, w), sync, 0.4)
        copy = _rounds(lambda: dst.copy_(src), sync, 0.3)
    work = (2 * n ** 3, 2 * c * 27 * c * 5 * hw[0] * hw[1], 2 * src.numel())
    return tuple(Rates(*(w_ / pick(t) for w_, t in zip(work, (mm, conv, copy))))
                 for pick in (min, max))


# -- a job's work, counted before it runs ------------------------------------------------------

_UNIT = (5, 32, 32)  # frames, height, width of the VAE's small counted run


class _ByText:
    """A configuration (a dataclass holding lists) as a cache key: by its text."""

    def __init__(self, config):
        self.config, self.text = config, repr(config)

    def __hash__(self):
        return hash(self.text)

    def __eq__(self, other):
        return isinstance(other, _ByText) and other.text == self.text


@functools.lru_cache(maxsize=4)
def _vae_unit(config: _ByText, dtype: torch.dtype) -> Counter:
    """The VAE's ops encoding and decoding ``_UNIT`` on meta tensors."""
    vae = build_on_meta("vae", config.config).to(dtype).eval()
    counter, (t, h, w) = OpCounter(), _UNIT
    s, f = vae.spatial_factor, vae.temporal_factor
    with torch.no_grad(), counter, torch.device("meta"):
        counter.phase = "encode"
        vae.encode_posterior(torch.empty(1, 3, t, h, w, dtype=dtype))
        counter.phase = "decode"
        vae.decode(torch.empty(1, vae.latent_channels, (t - 1) // f + 1, h // s, w // s,
                               dtype=dtype))
    return counter.ops


def _dit_ops(dit: torch.nn.Module, thw: tuple[int, int, int], txt: int, itemsize: int,
             counter: OpCounter):
    """The DiT's matrix products (2 FLOPs a token and weight: video weights over the video
    tokens, text ones over the text, shared ones over both, the timestep's over one; a
    video-only block's text outputs are not computed) and its windowed attention (each
    window's video tokens and the text, against themselves)."""
    tokens = thw[0] * thw[1] * thw[2]
    counter.phase = "dit"
    for name, p in dit.named_parameters():
        if p.dim() != 2:
            continue
        parts = name.split(".")
        text_out = parts[0] == "blocks" and dit.blocks[int(parts[1])].video_only and \
            parts[2:4] != ["attn", "proj_qkv"]  # only the text's keys and values are needed
        stream = "txt" if "txt" in parts or parts[0] == "txt_in" else "all" if "all" in parts \
            else "emb" if parts[0] == "emb_in" else "vid"
        n = {"txt": 0 if text_out else txt, "all": tokens + (0 if text_out else txt),
             "emb": 1, "vid": tokens}[stream]
        counter.add("linear", 2 * n * p.numel(), itemsize * (p.numel() + n * sum(p.shape)))
    inner = dit.config.heads * dit.config.head_dim
    for block in dit.blocks:
        for t0, t1, h0, h1, w0, w1 in make_windows(block.window_method, thw, block.window):
            k = (t1 - t0) * (h1 - h0) * (w1 - w0) + txt
            q = k - txt if block.video_only else k
            counter.add("attention", 4 * q * k * inner, itemsize * (2 * q + 2 * k) * inner)


@dataclass(frozen=True)
class JobWork:
    """The counted ops of a whole job and the frames it outputs."""

    ops: Counter
    frames: int

    @property
    def flops(self) -> float:
        return sum(flops * n for (_, _, flops, _), n in self.ops.items())

    def seconds(self, device: str, dtype: torch.dtype) -> tuple[float, float]:
        """The time range on ``device`` at its probed best and worst rates."""
        return tuple(sum(n * r.seconds(cls, flops, nbytes)
                         for (_, cls, flops, nbytes), n in self.ops.items())
                     for r in device_rates(device, dtype))

    def describe(self, device: str, dtype: torch.dtype) -> str:
        lo, hi = self.seconds(device, dtype)
        return (f"{self.flops / 1e12:.1f} TFLOP, {self.flops / 1e12 / self.frames:.2f} TFLOP a "
                f"frame; about {_duration(lo)} to {_duration(hi)} on {device} (from a probe of "
                f"its {str(dtype).removeprefix('torch.')} throughput)")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def job_work(dit: torch.nn.Module, vae_config, plan, opts, size: tuple[int, int],
             dtype: torch.dtype) -> JobWork:
    """The work of ``plan``'s batches at output ``size`` (H, W): the VAE's small counted run
    scaled to each batch's padded frames and tiles, the DiT's counted per batch."""
    H, W = (-(-n // MODEL_MULTIPLE) * MODEL_MULTIPLE for n in size)
    unit = _vae_unit(_ByText(vae_config), dtype)
    grow = {}
    for stage in ("encode", "decode"):
        tiles, _ = settings_from_options(opts, stage)
        grow[stage] = 1.0
        if tiles.enabled and not tiles.exact:
            for n in (H // 8, W // 8):
                starts, edge = tile_layout(n, tiles.tile_size // 8, tiles.tile_overlap // 8)
                grow[stage] *= len(starts) * edge / n
    counter = OpCounter()
    for b in plan.batches:
        scale = b.length * H * W / (_UNIT[0] * _UNIT[1] * _UNIT[2])
        for (phase, cls, flops, nbytes), n in unit.items():
            counter.phase = phase
            counter.add(cls, flops, nbytes, n * scale * grow[phase])
        _dit_ops(dit, ((b.length - 1) // 4 + 1, H // 16, W // 16), TEXT_TOKENS, dtype.itemsize,
                 counter)
    return JobWork(counter.ops, plan.source_frames)


def log_work(models, plan, opts, size: tuple[int, int]) -> None:
    """Log the plan's work and time, at INFO only: the probe takes a second per device and dtype."""
    if log.isEnabledFor(logging.INFO):
        work = job_work(models.dit, models.vae.config, plan, opts, size, models.dtype)
        log.info("work: %s", work.describe(str(models.dit_device), models.dtype))
