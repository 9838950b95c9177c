"""Device memory of a job at real size, traced on fake tensors: no GPU, no weights, seconds.

The shipped DiT (3B, 7B) and VAE configurations are built under ``FakeTensorMode`` on a fake
``cuda:0`` (tensors with shapes, dtypes and devices but no data), and the pipeline's own
phase functions (``Upscaler._encode``, ``_denoise``, ``_decode``: frame upload, resize,
tiled/sliced VAE, DiT forward, colour correction) run on them under a dispatch mode that
counts the bytes of every live storage on the traced device (each storage once; freed when
its last tensor is collected). Fused attention is traced as the GPU kernels allocate (their
output and the float32 log-sum-exp), not as the math fallback fake tensors would otherwise
take. What the trace cannot see: the CUDA caching allocator's rounding and fragmentation,
cuDNN/cuBLAS workspaces and the CUDA context (the budget's fixed allowance and margin), and
kernels' internal scratch.

Per phase (encode, DiT, decode) a row gives ``weights_bytes`` (the model tensors resident on
the device during the phase under the setting), ``trace_bytes`` (those plus the traced peak
of the phase's activations) and ``estimate_bytes`` (``seedvr2.memory.budget``'s figure for
the same phase without its fixed CUDA workspace allowance). Settings, as in the README's
table: ``defaults`` (everything on the GPU), ``tiled`` (VAE tiles of 512 px, both models
offloaded between phases), ``swapped`` (that and every DiT block swapped, with the I/O
layers). bf16, 16:9 output, the input at half the output size in uint8.

    python bench/memory_trace.py [--model 3b|7b] [--resolution 720|1080|2160] [--batch-size 5]
                                 [--setting defaults|tiled|swapped] [--json] [--all]
                                 [--vae-int8-cache off|on|host]

``--vae-int8-cache``: the VAE's causal tails in int8 (the option ``vae_int8_cache``; ``host``
parks them in host memory, which the trace does not count). The cache exists only when a batch
is decoded (encoded) in more than one temporal slice: at batch 5 it changes nothing.

``--all`` traces every cell of the README's table (both models, three resolutions, three
settings, batch 5, and batch 21 at 1080p) and prints the ratio estimate/trace of each.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from seedvr2.memory import budget as mem  # noqa: E402
from seedvr2.memory.placement import named_tensors  # noqa: E402
from seedvr2.memory import tiling  # noqa: E402
from seedvr2.memory.tiling import settings_from_options  # noqa: E402
from seedvr2.models import window  # noqa: E402
from seedvr2.models.config import dit_config, vae_config  # noqa: E402
from seedvr2.models.vae_paths import INT8_CACHE_BYTES, VaePaths  # noqa: E402
from seedvr2.options import OptionError, resolve_options, spoken_as_cli  # noqa: E402
from seedvr2.pipeline.plan import Batch  # noqa: E402
from seedvr2.pipeline.runner import Models, Upscaler  # noqa: E402

RESOLUTIONS = {720: (720, 1280), 1080: (1080, 1920), 2160: (2160, 3840)}
SETTINGS = ("defaults", "tiled", "swapped")
PHASES = ("encode", "DiT", "decode")
DTYPE = torch.bfloat16
GIB = 1 << 30


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages on ``device`` made by the operations it sees (each
    storage once, forgotten when it is collected) and the peak since :meth:`reset_peak`."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)
        self.live: dict = {}
        self.now = self.peak = 0

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type and \
            (self.device.index is None or t.device.index in (None, self.device.index))

    def track(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key):
        self.now -= self.live.pop(key, 0)

    def reset_peak(self):
        gc.collect()
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and self._on_device(t):
                self.track(t)
        return out


def _fused_attention(q, k, v, *args, **kwargs):
    """What a fused attention kernel (flash, cuDNN, memory-efficient) allocates: the output
    (laid out as q is), and the float32 log-sum-exp of (batch, heads, queries). q/k/v: (..., heads, seq, dim) as
    ``F.scaled_dot_product_attention`` takes them."""
    lse = torch.empty(*q.shape[:-1], dtype=torch.float32, device=q.device)
    del lse
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q)  # the kernels write the output in q's memory layout
    return torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)


_REAL_TENSOR = torch.tensor


def _host_constant(data, *args, **kwargs):
    """``torch.tensor`` of host values (the DiT's shape rows) as a real tensor: the trace
    reads them as Python numbers, which fake tensors cannot give."""
    if kwargs.get("device") not in (None, "cpu"):
        return _REAL_TENSOR(data, *args, **kwargs)
    with unset_fake_temporarily():
        return _REAL_TENSOR(data, *args, **kwargs)


class _Stream:
    stream_id = 0

    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class _Event:
    def record(self, stream=None):
        pass


class _HostArena:
    """A parked tail's host memory (``placement.tail_parking``) as a fake CPU tensor: the
    trace counts the device, and fake tensors have no address to pin."""

    def __init__(self, n: int):
        self.views = [torch.empty(n, dtype=torch.int8)]

    def copy_into(self, index: int, out: torch.Tensor):
        out.copy_(self.views[index], non_blocking=True)


@contextlib.contextmanager
def traceable(attention: Callable = _fused_attention):
    """The few places that ask the CUDA runtime (absent here) or read values, stubbed;
    ``attention`` stands in for ``F.scaled_dot_product_attention``."""
    with mock.patch.object(F, "scaled_dot_product_attention", attention), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: _Stream()), \
            mock.patch.object(torch.cuda, "Stream", _Stream), \
            mock.patch.object(torch.cuda, "Event", _Event), \
            mock.patch.object(torch.cuda, "stream", lambda stream: contextlib.nullcontext()), \
            mock.patch.object(torch.Tensor, "record_stream", lambda self, stream: None), \
            mock.patch.object(tiling, "tail_parking", lambda device: _HostArena), \
            mock.patch.object(torch.Tensor, "pin_memory", lambda self, *a, **k: self), \
            mock.patch.object(torch, "tensor", _host_constant):
        try:
            yield
        finally:
            window._layouts.clear()  # cached layouts of fake tensors


@dataclass(frozen=True)
class Cell:
    model: str
    resolution: int
    batch_size: int
    setting: str
    int8_cache: str = "off"  # the option vae_int8_cache

    @property
    def size(self) -> tuple[int, int]:
        return RESOLUTIONS[self.resolution] if self.resolution in RESOLUTIONS else \
            (self.resolution, self.resolution * 16 // 9 // 16 * 16)

    @property
    def input_size(self) -> tuple[int, int]:
        return self.size[0] // 2, self.size[1] // 2

    def options(self):
        tiled = {"vae_encode_tiled": True, "vae_decode_tiled": True} if self.setting != "defaults" \
            else {}
        return resolve_options(batch_size=self.batch_size, resolution=self.size[0],
                               color_correction="wavelet", vae_int8_cache=self.int8_cache,
                               **tiled)

    def placement(self, blocks: int, device: str) -> mem.Placement:
        if self.setting == "defaults":
            return mem.Placement(device, device)
        swap = self.setting == "swapped"
        return mem.Placement(device, device, "cpu", "cpu", blocks if swap else 0, swap)


def _phase_weights(place: mem.Placement, dit_w: mem.Weights, vae_w: mem.Weights) -> dict:
    """Bytes of model tensors resident on the compute device during each phase: the phase's
    own model (under BlockSwap: the resident part plus two blocks in flight), and the other
    model unless it is offloaded."""
    dit = dit_w.resident(place.blocks_to_swap, place.swap_io) if place.swapping else dit_w.total
    parked_dit = 0 if place.dit_offload is not None else dit_w.total
    parked_vae = 0 if place.vae_offload is not None else vae_w.total
    return {"encode": vae_w.total + parked_dit, "DiT": dit + parked_vae,
            "decode": vae_w.total + parked_dit}


def _materialised(kind: str, config, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model built on meta, then every tensor made on ``device`` as the loader places
    it (``dtype``; RoPE frequencies in float32; their tables, a few KiB, are not shared)."""
    from seedvr2.models import build_on_meta, set_tensor

    model = build_on_meta(kind, config)
    made: dict = {}
    for name, t in list(named_tensors(model)):
        if id(t) not in made:
            keep_fp32 = name.endswith("rope.rope.freqs") or not t.dtype.is_floating_point
            made[id(t)] = torch.empty(t.shape, device=device,
                                      dtype=t.dtype if keep_fp32 else dtype)
        set_tensor(model, name, made[id(t)])
    return model.eval().requires_grad_(False)


def build_models(dit_cfg, vae_cfg, device: str, dtype: torch.dtype) -> Models:
    """Both models with every tensor on ``device`` (fake under a FakeTensorMode)."""
    dit = _materialised("dit", dit_cfg, device, dtype)
    vae = _materialised("vae", vae_cfg, device, dtype)
    text = torch.zeros(mem.TEXT_TOKENS, dit.config.txt_in_dim)
    dev = torch.device(device)
    return Models(dit, vae, text, dev, dev, dtype)


@contextlib.contextmanager
def fake_models(model: str, device: str = "cuda:0", dtype: torch.dtype = DTYPE):
    """The shipped ``model`` (3b, 7b) and VAE at real size on fake tensors on ``device``, and
    the fake tensor mode they live in for the phases to run under (with :func:`traceable`)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield build_models(dit_config(model), vae_config("vae"), device, dtype)


def run_phases(models: Models, opts, size: tuple[int, int], input_size: tuple[int, int],
               phase: Callable[[str, Callable], object]) -> None:
    """One batch through the pipeline's phase functions (frame upload and resize, the VAE
    encode, the DiT, the VAE decode and colour correction), each run as
    ``phase(name, function)``, which returns the function's result."""
    batch = Batch(0, 0, opts.batch_size, opts.batch_size, 0)
    frames = [torch.zeros(*input_size, 3, dtype=torch.uint8) for _ in range(opts.batch_size)]
    up = Upscaler(models, opts)
    up._stops = lambda device=None: None  # no stop checks: no CUDA events to record
    item = phase("encode", lambda: up._encode(batch, frames, size))
    phase("DiT", lambda: up._denoise(item))
    phase("decode", lambda: up._decode(item))


def trace_phases(models: Models, opts, size: tuple[int, int], input_size: tuple[int, int],
                 device: str) -> dict:
    """Peak bytes of each phase's live tensors on ``device`` beyond the models' own (what
    earlier phases left there, such as the input frames kept for colour correction, included),
    counted under :class:`LiveBytes`."""
    counter = LiveBytes(device)
    for model in (models.dit, models.vae):  # weights are seen through views: count them first
        for _, t in named_tensors(model):
            if counter._on_device(t):
                counter.track(t)
    weights, peaks = counter.now, {}

    def traced(name: str, function: Callable):
        counter.reset_peak()
        result = function()
        peaks[name] = counter.peak - weights
        return result

    # Fake tensors need the stand-ins (no values, no CUDA runtime); real ones run as they are.
    fake = is_fake(next(models.dit.parameters()))
    with torch.no_grad(), (traceable() if fake else contextlib.nullcontext()), counter:
        run_phases(models, opts, size, input_size, traced)
    return peaks


@functools.lru_cache(maxsize=None)
def traced_activations(model: str, resolution: int, batch_size: int, tiled: bool,
                       device: str = "cuda:0", int8_cache: str = "off") -> dict:
    """Peak activation bytes per phase of one batch (the settings ``tiled`` and ``swapped``
    differ only in where weights are, so they share this)."""
    cell = Cell(model, resolution, batch_size, "tiled" if tiled else "defaults", int8_cache)
    with fake_models(model, device) as models:
        models.vae.set_conv_settings(cudnn_benchmark=False, paths=VaePaths(
            int8_cache_bytes=None if int8_cache == "off" else INT8_CACHE_BYTES,
            cache_offload=int8_cache == "host"))
        return trace_phases(models, cell.options(), cell.size, cell.input_size, device)


def trace_cell(cell: Cell, device: str = "cuda:0") -> list[dict]:
    """The rows of one cell: per phase weights, trace and estimate (see the module text)."""
    dit_cfg, vae_cfg = dit_config(cell.model), vae_config("vae")
    peaks = traced_activations(cell.model, cell.resolution, cell.batch_size,
                               cell.setting != "defaults", device, cell.int8_cache)
    dit_w, vae_w = (mem.Weights.from_config(kind, cfg, DTYPE.itemsize)
                    for kind, cfg in (("dit", dit_cfg), ("vae", vae_cfg)))
    place = cell.placement(len(dit_w.blocks), device)
    weights = _phase_weights(place, dit_w, vae_w)
    est = estimate_phases(mem.Budget(dit_cfg, vae_cfg, dit_w, vae_w), cell.options(), cell.size,
                          place, device)
    return [{"model": cell.model, "resolution": cell.resolution, "batch_size": cell.batch_size,
             "setting": cell.setting, "int8_cache": cell.int8_cache, "phase": phase,
             "weights_bytes": weights[phase],
             "trace_bytes": weights[phase] + peaks[phase], "estimate_bytes": est[phase]}
            for phase in PHASES]


def budget_job(opts, size: tuple[int, int], dtype_bytes: int) -> mem.BatchShape:
    """The budget's view of the traced batch (tensors wait on the CPU between phases)."""
    (encode, encode_slice), (decode, decode_slice) = (settings_from_options(opts, stage)
                                                      for stage in ("encode", "decode"))
    return mem.BatchShape(size[0], size[1], opts.batch_size, dtype_bytes, mem.TEXT_TOKENS,
                          encode, decode, None, encode_slice, decode_slice,
                          vae_int8_cache=opts.vae_int8_cache)


def estimate_phases(budget: mem.Budget, opts, size, place: mem.Placement, device: str) -> dict:
    """The budget's bytes per phase on ``device``, less its fixed allowance."""
    est = mem.estimate(budget, budget_job(opts, size, DTYPE.itemsize), place)
    fixed = mem.fixed_overhead(device)
    return {p.phase: p.total - fixed for p in est.phases if p.device == device}


def readme_cells() -> list[Cell]:
    cells = [Cell(m, r, 5, s) for m in ("3b", "7b") for r in (720, 1080, 2160) for s in SETTINGS]
    return cells + [Cell(m, 1080, 21, s) for m in ("3b", "7b") for s in SETTINGS]


def table(rows: list[dict]) -> str:
    lines = ["| model | resolution | batch | setting | phase | weights GiB | trace GiB | "
             "estimate GiB | estimate/trace |", "|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        setting = r["setting"] + ("" if r.get("int8_cache", "off") == "off"
                                  else f", int8 cache {r['int8_cache']}")
        lines.append(f"| {r['model']} | {r['resolution']}p | {r['batch_size']} | {setting} | "
                     f"{r['phase']} | {r['weights_bytes'] / GIB:.2f} | "
                     f"{r['trace_bytes'] / GIB:.2f} | {r['estimate_bytes'] / GIB:.2f} | "
                     f"{r['estimate_bytes'] / r['trace_bytes']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("3b", "7b"), default="3b")
    parser.add_argument("--resolution", type=int, choices=sorted(RESOLUTIONS), default=1080)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--setting", choices=SETTINGS, default="defaults")
    parser.add_argument("--vae-int8-cache", choices=("off", "on", "host"), default="off",
                        help="the option vae_int8_cache (the VAE's causal tails in int8)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--all", action="store_true", help="every cell of the README's table")
    args = parser.parse_args(argv)
    try:  # the option table's bounds and 4n+1 rule, as `seedvr2 upscale` checks them
        with spoken_as_cli():
            resolve_options(batch_size=args.batch_size)
    except OptionError as e:
        parser.error(str(e))
    cells = readme_cells() if args.all else \
        [Cell(args.model, args.resolution, args.batch_size, args.setting, args.vae_int8_cache)]
    rows = []
    for cell in cells:
        rows += trace_cell(cell)
        print(f"traced {cell}", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    bad = [r for r in rows if not 1.0 <= r["estimate_bytes"] / r["trace_bytes"] <= 1.3]
    return 1 if args.all and bad else 0


if __name__ == "__main__":
    sys.exit(main())
