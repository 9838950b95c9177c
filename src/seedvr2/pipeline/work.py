"""The work of a job before it runs (FLOPs and bytes per phase) and its time on the device.

:class:`OpCounter` counts every operation it sees: FLOPs by torch's formulas
(``torch.utils.flop_counter``; the fused attention by ``sdpa_flop_count``; comfy-kitchen's
``fp16_conv3d`` as a convolution) and bytes read and written as if nothing were fused (views
move nothing). ``bench/roofline.py`` runs it over a whole batch at real size on fake tensors; a
job's estimate (:func:`job_work`) runs the models on ``meta`` tensors at a small size and
scales: the VAE's convolutions are local (work per output pixel and frame; its attention, a
few % at 1080p, at that size's share), the DiT's work per video token plus its windowed
attention (each window's tokens against themselves and the text). :func:`device_rates` probes
the device for about a second (cached per device and dtype); :meth:`JobWork.seconds` is then
the counted work at those rates, a range from the probe's best and worst rounds.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

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
    """(best, worst) rates of ``device`` in ``dtype`` over about a second of short rounds
    (a matrix product, a 3x3x3 convolution as the VAE's, a copy), cached for the process."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n, c, hw = (4096, 256, 64) if dev.type == "cuda" else (512, 128, 24)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    x = torch.randn(1, c, 4, hw, hw, device=dev, dtype=dtype)
    w = torch.randn(c, c, 3, 3, 3, device=dev, dtype=dtype)
    src = torch.empty(n * n * 4, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    with torch.no_grad():
        mm = _rounds(lambda: a @ a, sync, 0.3)
        conv = _rounds(lambda: F.conv3d(x, w, padding=1), sync, 0.4)
        copy = _rounds(lambda: dst.copy_(src), sync, 0.3)
    work = (2 * n ** 3, 2 * c * 27 * x.numel(), 2 * src.numel())
    return tuple(Rates(*(w_ / pick(t) for w_, t in zip(work, (mm, conv, copy))))
                 for pick in (min, max))


def seconds_at(ops: Counter, rates: Rates) -> dict:
    """Per phase: the counted ops' time at ``rates``."""
    out: dict = {}
    for (phase, cls, flops, nbytes), n in ops.items():
        out[phase] = out.get(phase, 0.0) + n * rates.seconds(cls, flops, nbytes)
    return out
