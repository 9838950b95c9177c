"""What the first GPU run must measure, in one command and one table (bench/gpu_checks.sh).

Random weights of the real shapes (3B and 7B DiT, the released VAE); nothing is downloaded
or installed. Sections, in order of value (``--sections`` picks some):

* env       the GPU, torch, what ``dtype=auto`` and ``attention_backend=auto`` choose here
* e2e       ``seedvr2.upscale`` of a synthetic 21-frame clip to 1080p with the 3B, run twice:
            frames/s of the second (steady state) run, seconds per phase, peaks vs the budget;
            then 9 frames within max_vram 8 and 12 GiB (the fit's choice; the models given
            from host memory): the allocated peak must stay within the cap less the
            budget's allowance
* trace     the pipeline's phases of one 3B batch at 720p untiled and 1080p with 512-pixel VAE
            tiles: torch.cuda.max_memory_allocated and max_memory_reserved per phase beside
            the fake-tensor trace of the same job (bench/memory_trace.py) and the budget's
            estimate, to calibrate the budget's fixed allowance and margin
* mfu       3B DiT forward at 720p and 1080p x 21: time, model FLOP utilisation against the
            data-sheet dense peak, the attention kernel the profiler saw (flash / cuDNN /
            mem-efficient / math / FlashAttention-3), and the host syncs of a 3B and a 7B
            forward (torch.cuda sync debug mode, and the device->host reads in the trace)
* blockswap 3B forward at 720p x 21 with 0 / 16 / 32 blocks swapped: time, peak allocated
            and reserved against resident weights + 2 blocks, host->device copy GB/s and the
            share of copy time overlapping kernels (profiler), bytes pinned by our arena
* vae       VAE encode and decode of 1080p x 21 (default temporal slices) with
            ``vae_cudnn_benchmark`` and ``vae_channels_last`` off and on; host syncs of a decode
* dequant   GGUF Q8_0 / Q4_K and fp8 dequantisation of every packable 3B weight: ms per forward
* room      ComfyUI's dynamic VRAM: a resident model holding all but 1 GiB of the device, freed
            only when asked (as ComfyUI's free_memory does): the automatic batch size with the
            device empty, with the resident model and no request, and with the job's request
            for room (``make_room``), which should give the empty device's choice
* lowp      3B DiT forward at 1080p x 21 in bf16, then with its block linears in int8,
            int8_convrot, fp8 e4m3, mxfp8 and nvfp4, each with ``compute_precision`` weights
            (dequantise) and auto (comfy-kitchen's low-precision products where this GPU has
            them): time, peak memory, relative L2 difference from bf16, layers per path.
            Needs comfy-kitchen (else one skipped row); past the 8-minute default, so run it
            as ``--sections lowp`` (about 2.5 minutes)
* vae_paths VAE encode + decode of 1080p x 21 in fp16 (default temporal slices) on each of the
            VAE's kernel paths (``seedvr2.models.vae_paths``): today, channels_last,
            fused_norm, fp16_accumulation, int8_cache; one line per path
            ``vae_paths PATH: time T s, peak P GiB, PSNR D dB vs today`` (the decoded video
            against today's). Also past the default: ``--sections vae_paths`` (about 4 minutes)

The table goes to stdout at the end and, when ``OUT`` is set, to ``$OUT/gpu_checks.md`` after
every row, so a run stopped at its time limit still returns what it measured. Each section
has a time cap; none starts after ``--minutes``.

``--rehearse`` runs every section end to end on the CPU with the tiny test models at small
sizes (real allocations, copies and weights; seconds): CUDA-only quantities are replaced by
their labelled CPU analogues (host reads instead of stream syncs, host memcpy instead of
host->device copies, the schedule's resident blocks instead of allocator peaks).

``--rehearse --fake-cuda`` runs the sections down the GPU run's own branch at the real sizes on
a fake ``cuda:0`` of each ``--capability`` (tests/fake_cuda.py; docs/development.md, "The
fake-CUDA rehearsal"): rows marked ``(fake cuda)``, numbers that need data ``n/a (fake)``.

    bench/gpu_checks.sh [--rehearse [--fake-cuda] [--capability 7.5,8.0,8.9,10.0,12.0]]
                        [--minutes 8]
                        [--sections env,e2e,trace,mfu,blockswap,vae,dequant,room,lowp,vae_paths]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import importlib.util
import json
import math
import os
import platform
import re
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # bench/common.py, bench/dit_forward.py
sys.path.insert(0, str(BENCH.parent / "tests"))  # tests/kernel_checks.py: the CPU stand-in

from common import best_time  # noqa: E402
from dit_forward import count_flops  # noqa: E402
from kernel_checks import KernelCheckFailed  # noqa: E402

from seedvr2.models import build_dit, build_vae, dit_config, vae_config  # noqa: E402
from seedvr2.models.config import shipped_config  # noqa: E402
from seedvr2.models.vae_paths import VaePaths  # noqa: E402

SECTIONS = ("env", "e2e", "trace", "mfu", "blockswap", "vae", "dequant", "room", "lowp",
            "vae_paths")
# Seconds each section may run on the GPU (its rows then stop). The alarm fires between Python
# steps only (a running kernel, copy or cuDNN benchmark finishes first), so a section may run
# up to SLACK past its cap: the default sections' caps total at most 420 s, leaving each its
# slack within the 8-minute default (lowp and vae_paths run past it: --sections). The
# rehearsal's sections take seconds; REHEARSE_CAP only bounds a hang.
CAPS = {"env": 10, "e2e": 115, "trace": 50, "mfu": 60, "blockswap": 65, "vae": 65,
        "dequant": 30, "room": 25, "lowp": 150, "vae_paths": 240}
SLACK = 7
DEFAULT_SECTIONS = ("env", "e2e", "trace", "mfu", "blockswap", "vae", "dequant", "room")
REHEARSE_CAP = 60
FAKE_CUDA_CAP = 600  # the fake-CUDA rehearsal's sections (real shapes on fake tensors)
FAKE_NUMBER = "n/a (fake)"
MIN_SECTION_SECONDS = 5  # a section with less time left is skipped, not started
TEXT_TOKENS = 58
# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' data sheets, per product
# as torch names it (the first name contained in the device's wins: PCIe and NVL boards run
# slower clocks and fewer SMs than SXM ones of the same family); a GPU not listed gets MFU
# against its measured matmul rate only.
BF16_PEAK = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12),
             ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12),
             ("RTX 4090", 165e12))


def bf16_peak(name: str) -> Optional[float]:
    """The data-sheet dense bf16 peak of the GPU torch calls ``name``, or None."""
    return next((peak for product, peak in BF16_PEAK if product in name), None)
CONFORMANCE = BENCH.parent / "tests" / "conformance"  # the tiny models' configs


class UsageError(ValueError):
    pass


class SectionTimeout(BaseException):
    """Raised by the section's alarm; a BaseException so rows' ``except Exception`` let it by."""


# -- sizes -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scale:
    """The models and sizes of a run: the real ones on the GPU, tiny ones for the rehearsal."""

    name: str
    dit3b: object
    dit7b: object  # the 7B's widths and window rules, first blocks only
    vae: object
    frames: int
    sizes: dict  # label -> output (H, W), multiples of 16
    e2e_input: tuple  # (H, W) of the synthetic clip
    e2e_resolution: int
    swaps: tuple  # blocks swapped in the blockswap rows
    matmul: int  # side of the square matmul that gives the reference rate
    dtype: torch.dtype
    repeats: int
    label: Callable = str  # how a size label reads in a row
    int8_cache_bytes: int = 64 << 20  # the vae_paths int8 row's threshold (vae_paths's own)
    paths_clip: tuple = (21, 1088, 1920)  # the vae_paths clip: frames, H, W

    @property
    def dtype_option(self) -> str:
        """The ``dtype`` option naming this scale's precision."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]

    @property
    def blocks_3b(self) -> int:
        return self.dit3b.num_layers


SHORT_7B_BLOCKS = 2  # both window rules; host syncs do not depend on the block count


def _short(config, blocks: int):
    return dataclasses.replace(
        config, num_layers=blocks,
        **{key: getattr(config, key)[:blocks] for key in ("block_type", "window", "window_method")})


def full_scale() -> Scale:
    return Scale("GPU", dit_config("3b"), _short(dit_config("7b"), SHORT_7B_BLOCKS),
                 vae_config(shipped_config("vae")), 21,
                 # 1080 rounded up to a multiple of 16, as the pipeline pads it
                 {"720p": (720, 1280), "1080p": (1088, 1920)}, (540, 960), 1080, (0, 16, 32),
                 8192, torch.bfloat16, 3)


def rehearse_scale() -> Scale:
    def tiny(name):
        return json.loads((CONFORMANCE / name / "config.json").read_text())["constructor_kwargs"]

    sizes = {"720p": (32, 32), "1080p": (32, 48)}
    return Scale("rehearsal", dit_config(tiny("dit3b_tiny")),
                 _short(dit_config(tiny("dit7b_tiny")), SHORT_7B_BLOCKS),
                 vae_config(tiny("vae_tiny")), 5, sizes, (16, 24), 32, (0, 2, 4), 256,
                 torch.float32, 2, label=lambda s: f"{s} stand-in {sizes[s][0]}x{sizes[s][1]}",
                 int8_cache_bytes=4096, paths_clip=(9, 16, 16))


# -- the report ------------------------------------------------------------------------------------

# A number a fake GPU cannot give (a time or a difference of values: NaN there) and its unit.
_NO_DATA = re.compile(r"-?nan(?:x|%| ?(?:ms|s|frames/s|TFLOP/s|GB/s|dB)\b)?")


@dataclass
class Report:
    out: Optional[Path] = None
    header: str = ""
    rows: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    fake: bool = False  # rows of the fake-CUDA rehearsal: marked, numbers of data "n/a (fake)"

    def add(self, section: str, what: str, value: str, note: str = ""):
        if self.fake:
            what += " (fake cuda)"
            value, note = (_NO_DATA.sub(FAKE_NUMBER, str(text)) for text in (value, note))
        self.rows.append((section, what, value, note))
        print(f"[{time.monotonic() - self.started:6.1f}s] {section}: {what} = {value}  {note}",
              file=sys.stderr, flush=True)
        self.write()

    def table(self) -> str:
        cell = lambda text: str(text).replace("|", "/").replace("\n", " ")  # noqa: E731
        lines = ["| section | measurement | value | note |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(cell(c) for c in row)} |" for row in self.rows]
        return "\n".join(lines)

    def markdown(self) -> str:
        elapsed = time.monotonic() - self.started
        return f"{self.header}, {elapsed:.0f} s so far\n\n{self.table()}\n"

    def write(self):
        """The table so far to ``$OUT/gpu_checks.md`` (renamed into place: never half written)."""
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        part = self.out / "gpu_checks.md.partial"
        part.write_text(self.markdown())
        os.replace(part, self.out / "gpu_checks.md")


def measure(report: Report, section: str, what: str, fn: Callable[[], tuple]):
    """One row: ``fn() -> (value, note)``; an exception becomes an error row, not a lost table."""
    try:
        value, note = fn()
    except ModuleNotFoundError as e:
        report.add(section, what, "skipped", f"needs {e.name}, which is not installed here")
    # A kernel check is a BaseException (the code under test cannot swallow it): here a row.
    except (Exception, KernelCheckFailed) as e:  # noqa: BLE001 -- the table is the product
        report.add(section, what, "error", f"{type(e).__name__}: {e}"[:400])
    else:
        report.add(section, what, value, note)


@contextlib.contextmanager
def time_cap(seconds: float):
    """SectionTimeout after ``seconds`` (delivered between Python steps: a running kernel or
    copy finishes first)."""
    def fire(signum, frame):
        raise SectionTimeout

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- the device ------------------------------------------------------------------------------------

@dataclass
class Run:
    """What every section gets: the device, the scale, the report."""

    device: torch.device
    scale: Scale
    report: Report
    capabilities: tuple = ((12, 0),)  # the rehearsal's stand-ins (--capability); a GPU: its own
    lines: list = field(default_factory=list)  # the lowp section's summary lines
    fake: object = None  # the fake GPU (tests/fake_cuda.py) of the fake-CUDA rehearsal

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def add_line(self, line: str) -> str:
        """A summary line (printed at the end), numbers of data "n/a (fake)" on a fake GPU."""
        if self.fake is not None:
            line = _NO_DATA.sub(FAKE_NUMBER, line)
        self.lines.append(line)
        return line

    def time(self, fn, repeats: Optional[int] = None) -> float:
        """Best seconds of ``fn``; on a fake GPU, ``fn`` once and NaN (no time to take)."""
        if self.fake is not None:
            fn()
            return float("nan")
        return best_time(fn, self.scale.repeats if repeats is None else repeats, self.sync)

    def reset_peaks(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self) -> str:
        if not self.cuda:
            return "allocator peaks: CUDA only"
        return (f"peak allocated {gib(torch.cuda.max_memory_allocated(self.device))}, "
                f"reserved {gib(torch.cuda.max_memory_reserved(self.device))}")

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def gib(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2 ** 30:.2f} GiB" if abs(n) >= 2 ** 28 else f"{n / 2 ** 20:.1f} MiB"


def tensor_bytes(module) -> int:
    seen = {}
    for t in list(module.parameters()) + list(module.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


# -- models with random weights of the real shapes -------------------------------------------------

def random_model(build, config, device: torch.device, dtype: torch.dtype):
    """``build(config)`` made on ``device`` in ``dtype`` with N(0, 0.02) weights (biases 0,
    norm gains 1). Made in its dtype where it runs: float32 weights converted on the device
    would leave the allocator's cache split around them (issue 42); and fake tensors cannot be
    swapped in by ``to_empty``."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), torch.no_grad():
            model = build(config).eval()
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
    finally:
        torch.set_default_dtype(default)
    return model.requires_grad_(False)


def random_dit(run: Run, config=None, device=None):
    dit = random_model(build_dit, config or run.scale.dit3b, device or run.device, run.scale.dtype)
    dit.set_attention_backend("auto")  # the default option: what a job runs
    dit.embedded_text_embeddings = {"pos": torch.randn(TEXT_TOKENS, dit.config.txt_in_dim)}
    return dit


def random_vae(run: Run):
    return random_model(build_vae, run.scale.vae, run.device, run.scale.dtype)


def dit_inputs(run: Run, size: str, txt_in_dim: int):
    h, w = run.scale.sizes[size]
    thw = ((run.scale.frames - 1) // 4 + 1, h // 8, w // 8)
    device, dtype = run.device, run.scale.dtype
    vid = torch.randn(math.prod(thw), 33, device=device, dtype=dtype)
    txt = torch.randn(TEXT_TOKENS, txt_in_dim, device=device, dtype=dtype)
    # Shapes on the CPU (host facts, as the pipeline passes them); timestep on the device.
    return (vid, txt, torch.tensor([thw]), torch.tensor([[TEXT_TOKENS]]),
            torch.full((1,), 1000.0, device=device)), thw


# -- profiler readings -----------------------------------------------------------------------------

# Ops that read a device value back to the host (a stream sync on CUDA): on the CPU the count
# of these in a trace is the analogue of the sync debug mode's count.
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                 "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim")


def _profile(run: Run, fn):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if run.cuda and run.fake is None:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        run.sync()
    return prof


def _fake_ops(run: Run, fn) -> collections.Counter:
    """The operations ``fn`` ran on the fake GPU, from its log, named as the profiler names
    them (``aten::op``): the profiler sees none of a fake tensor's operations."""
    start = len(run.fake.log)
    fn()
    return collections.Counter("aten::" + op.detail.split(".")[0]
                               for op in run.fake.log[start:] if op.kind == "op")


def _device_events(prof):
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def host_syncs(run: Run, fn) -> tuple[str, str]:
    """(value, note) of a row counting the host syncs of ``fn``: on CUDA the stream syncs
    torch's sync debug mode reports; everywhere the device->host reads in a profiler trace."""
    if run.fake is not None:
        ops = _fake_ops(run, fn)
        reads = collections.Counter({n: c for n, c in ops.items() if n in HOST_READ_OPS})
        detail = ", ".join(f"{n.removeprefix('aten::')} x{c}" for n, c in reads.most_common())
        return (f"{sum(reads.values())} host reads",
                f"device->host reads in the fake GPU's log ({detail or 'none'})")
    syncs = None
    if run.cuda:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    prof = _profile(run, fn)
    reads = collections.Counter(e.name for e in prof.events() if e.name in HOST_READ_OPS)
    detail = ", ".join(f"{n.removeprefix('aten::')} x{c}" for n, c in reads.most_common()) or "none"
    total = sum(reads.values())
    if syncs is None:
        return (f"{total} host reads",
                f"CPU analogue of stream syncs: device->host reads in the trace ({detail})")
    return (f"{syncs} stream syncs",
            f"sync debug mode; device->host reads in the trace: {total} ({detail})")


def _attention_family(name: str) -> Optional[str]:
    n = name.lower()
    if "flash_attn_3" in n or "flash_attn_interface" in n or ("sm90" in n and "flash" in n
                                                               and "cudnn" not in n):
        return "FlashAttention-3"
    if "cudnn" in n and ("attention" in n or "sdpa" in n or "fmha" in n or "flash" in n):
        return "cuDNN attention"
    if "flash" in n:
        return "flash"
    if "efficient_attention" in n or "fmha" in n:
        return "mem-efficient"
    if "attention_math" in n:
        return "math"
    if "sageattn" in n or "sage" in n and "attn" in n:
        return "SageAttention"
    return None


def attention_kernel(run: Run, fn) -> tuple[str, str]:
    """(value, note): which attention kernel ``fn`` ran, from the profiler: the device kernels
    (by time) on CUDA, the aten ops on the CPU; the raw names in the note. On a fake GPU none:
    the profiler sees no fake operation, and the fake computes attention by a stand-in."""
    if run.fake is not None:
        fn()
        return FAKE_NUMBER, ("SDPA's kernel is torch's choice on the CUDA runtime; the fake GPU "
                             "computes attention with a stand-in (bench/memory_trace.py)")
    prof = _profile(run, fn)
    ops = collections.Counter(e.name for e in prof.events()
                              if e.device_type == torch.autograd.DeviceType.CPU
                              and _attention_family(e.name) and "backward" not in e.name)
    kernels = collections.Counter()
    for e in _device_events(prof):
        if _attention_family(e.name):
            kernels[e.name] += e.time_range.end - e.time_range.start
    names = kernels or ops
    if not names:
        return "none found", "no attention op or kernel in the trace"
    top = names.most_common(1)[0][0]
    note = ("device kernels by time: " + "; ".join(f"{k[:80]} {v / 1e3:.1f} ms" for k, v in
                                                   kernels.most_common(3))
            if kernels else "aten ops: " + "; ".join(f"{k} x{v}" for k, v in ops.most_common(3)))
    return _attention_family(top), note


def copy_overlap(prof) -> tuple[float, float]:
    """(host->device copy seconds, share of it while kernels ran) from a profiler trace."""
    copies, kernels = [], []
    for e in _device_events(prof):
        span = (e.time_range.start, e.time_range.end)
        if "Memcpy HtoD" in e.name:
            copies.append(span)
        elif "Memcpy" not in e.name and "Memset" not in e.name:
            kernels.append(span)
    kernels.sort()
    merged = []
    for s, t in kernels:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    total = sum(t - s for s, t in copies)
    hidden = sum(max(0.0, min(t, b) - max(s, a)) for s, t in copies for a, b in merged
                 if a < t and b > s)
    return total / 1e6, (hidden / total if total else float("nan"))


# -- sections --------------------------------------------------------------------------------------

def check_env(run: Run):
    from seedvr2.memory.device_choice import resolve_dtype
    from seedvr2.models.attention import FLASH_ATTN_3_MODULE, auto_backend

    r = run.report
    if run.cuda:
        props = torch.cuda.get_device_properties(run.device)
        capability = f"{props.major}.{props.minor}"
        r.add("env", "device", props.name, f"compute capability {capability}, "
              f"{gib(props.total_memory)}, {props.multi_processor_count} SMs, CUDA "
              f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
              f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}")
    else:
        r.add("env", "device", platform.processor() or platform.machine(),
              f"CPU rehearsal, {torch.get_num_threads()} torch threads")
    r.add("env", "software", f"torch {torch.__version__}",
          f"Python {platform.python_version()}; PyAV {'yes' if _installed('av') else 'no'}, "
          f"gguf {'yes' if _installed('gguf') else 'no'} (neither is needed here)")
    r.add("env", "dtype=auto chose", str(resolve_dtype("auto", run.device)).removeprefix("torch."),
          "policy.resolve_dtype")
    q = torch.empty(1, 1, 1, 8, device=run.device, dtype=run.scale.dtype)
    installed = {m: _installed(m) for m in (FLASH_ATTN_3_MODULE, "flash_attn", "sageattention")}
    r.add("env", "attention_backend=auto runs", auto_backend(q),
          "installed: " + ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in installed.items()))


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _synthetic_clip(frames: int, h: int, w: int) -> torch.Tensor:
    """Moving colour gradients, (T, H, W, 3) in [0, 1]."""
    t = torch.arange(frames, dtype=torch.float32)[:, None, None, None]
    y = torch.linspace(0, 1, h)[None, :, None, None]
    x = torch.linspace(0, 1, w)[None, None, :, None]
    return ((x + y + t / frames + torch.tensor([0.0, 0.33, 0.66])) % 1.0).contiguous()


def budget_phases(run: Run, dit, vae) -> dict:
    """The memory budget's estimate per phase (bytes) for the e2e job."""
    from seedvr2.memory import budget as mem
    from seedvr2.options import resolve_options
    from seedvr2.memory.fit import batch_shape

    device = str(run.device)
    budget = mem.Budget(dit.config, vae.config, mem.Weights.of_module(dit),
                        mem.Weights.of_module(vae))
    opts = resolve_options(batch_size=run.scale.frames)
    h, w = run.scale.e2e_input
    size = (run.scale.e2e_resolution, round(run.scale.e2e_resolution * w / h))
    job = batch_shape(opts, size, run.scale.frames, run.scale.dtype, TEXT_TOKENS, {device})
    placement = mem.Placement(device, device)
    return {p.phase.lower(): p.total for p in mem.estimate(budget, job, placement).phases}


def check_e2e(run: Run):
    import seedvr2
    from seedvr2.pipeline.runner import JobStats

    scale = run.scale
    dit, vae = random_dit(run), random_vae(run)
    clip = _synthetic_clip(scale.frames, *scale.e2e_input)
    dtype = scale.dtype_option
    options = dict(dit=dit, vae=vae, device=str(run.device), devices=str(run.device), dtype=dtype,
                   resolution=scale.e2e_resolution, batch_size=scale.frames)
    label = f"3B {dtype} {scale.e2e_resolution}p x {scale.frames}"
    if scale.name != "GPU":
        label = f"tiny 3B stand-in {dtype} {scale.e2e_resolution}p x {scale.frames}"
    for attempt in ("first run (warm-up)", "steady state (second run)"):
        def one_run():
            stats = JobStats()
            run.sync()
            start = time.perf_counter()
            out = seedvr2.upscale(clip, stats=stats, **options)
            seconds = time.perf_counter() - start if run.fake is None else float("nan")
            phases = ", ".join(f"{name} {p.seconds:.2f} s" for name, p in stats.phases.items())
            note = f"{seconds:.2f} s; per phase: {phases}; output {tuple(out.shape)}"
            if attempt.startswith("steady") and run.cuda:
                estimate = budget_phases(run, dit, vae)
                note += "; device peak allocated / reserved vs budget: " + ", ".join(
                    f"{name} {gib(p.device_allocated)} / {gib(p.device_reserved)} vs "
                    f"{gib(estimate.get(name))}" for name, p in stats.phases.items())
            return f"{scale.frames / seconds:.2f} frames/s", note
        measure(run.report, "e2e", f"{label}, {attempt}", one_run)
    del dit, vae, options
    run.free()
    check_cards(run)


# The cards users ask about ("which file fits my card"), as max_vram caps: the fit plans each
# job within the cap, and the allocator's peak must stay within it.
CARD_CAPS_GIB = (8, 12)
CARD_FRAMES = 9


def check_cards(run: Run):
    """3B at the e2e size within each ``max_vram`` cap (``fit auto`` choosing tiles, offload,
    BlockSwap), the models given from host memory as a user's loaded ones: a row is an error
    when the allocated peak of a phase passes the cap the job was planned within, less the
    budget's fixed allowance for what a GPU holds beside tensors."""
    import memory_trace
    import seedvr2
    from seedvr2.memory import budget as mem
    from seedvr2.pipeline.runner import JobStats

    scale, host = run.scale, torch.device("cpu")
    dit, vae = random_dit(run, device=host), random_model(build_vae, scale.vae, host, scale.dtype)
    clip = _synthetic_clip(CARD_FRAMES, *scale.e2e_input)
    dtype = scale.dtype_option
    for cap in CARD_CAPS_GIB:
        def card_row(cap=cap):
            stats = JobStats()
            run.free()
            # The job's own: what else the device holds is not the job's (max_vram caps its use).
            before = torch.cuda.memory_allocated(run.device) if run.cuda else 0
            # (On the CPU the analogue: the live tensor bytes, as the trace section counts them.)
            live = contextlib.nullcontext() if run.cuda else memory_trace.LiveBytes("cpu")
            with live:
                seedvr2.upscale(clip, dit, vae, stats=stats, device=str(run.device), dtype=dtype,
                                resolution=scale.e2e_resolution, max_vram=cap)
            allocated = [p.device_allocated - before for p in stats.phases.values()
                         if p.device_allocated is not None] if run.cuda else [live.peak]
            reserved = [p.device_reserved for p in stats.phases.values()
                        if p.device_reserved is not None]
            estimate = stats.estimated_bytes.get(str(run.device))
            # The plan keeps its fixed allowance (CUDA context, workspaces: not allocated
            # tensors) within the cap, so the tensors have the cap less that.
            tensors = (cap << 30) - mem.fixed_overhead(str(run.device))
            if max(allocated) > tensors:
                raise RuntimeError(f"the job allocated {gib(max(allocated))} planned within "
                                   f"max_vram {cap} GiB: {gib(tensors)} for tensors beside the "
                                   f"allowance (estimate {gib(estimate)})")
            value = f"{gib(max(allocated))} " + (
                "allocated" if run.cuda else "live tensor bytes (CPU: no allocator)")
            return value, (f"reserved {gib(max(reserved)) if reserved else 'n/a'} (all the "
                           f"device's); the budget's estimate {gib(estimate)}; batch "
                           f"{stats.batch_size}")
        model = "3B" if scale.name == "GPU" else "tiny 3B stand-in"
        measure(run.report, "e2e", f"{model} {dtype} {scale.e2e_resolution}p x {CARD_FRAMES} within "
                f"max_vram {cap} GiB (fit auto, models given from host memory)", card_row)


# (size, VAE tiled) of the trace section's cells; the 3B, the scale's frames, bf16 on a GPU.
TRACE_CELLS = (("720p", False), ("1080p", True))


def _trace_options(run: Run, height: int, tiled: bool):
    from seedvr2.options import resolve_options

    tile = 512 if run.cuda else 64  # the smallest tile; the rehearsal frames fit in one
    return resolve_options(batch_size=run.scale.frames, resolution=height, device=str(run.device),
                           vae_encode_tiled=tiled, vae_decode_tiled=tiled,
                           vae_encode_tile_size=tile, vae_decode_tile_size=tile,
                           vae_encode_tile_overlap=tile // 8, vae_decode_tile_overlap=tile // 8)


def _allocator_peaks(run: Run, weights: int):
    """A ``phase(name, function)`` for ``memory_trace.run_phases`` recording each phase's
    peaks: on CUDA the allocator's (allocated, reserved); on the CPU, its labelled analogue,
    the live tensor bytes (weights included) of the same dispatch-mode count as the trace."""
    import memory_trace

    peaks = {}

    def phase(name, function):
        run.free()
        if run.cuda:
            run.reset_peaks()
            result = function()
            run.sync()
            peaks[name] = (torch.cuda.max_memory_allocated(run.device),
                           torch.cuda.max_memory_reserved(run.device))
            return result
        with memory_trace.LiveBytes(str(run.device)) as counter:
            result = function()
        peaks[name] = (weights + counter.peak, None)
        return result
    return phase, peaks


def check_trace(run: Run):
    import memory_trace
    from torch._subclasses.fake_tensor import FakeTensorMode

    from seedvr2.memory import budget as mem
    from seedvr2.pipeline.runner import Models

    scale = run.scale
    dit, vae = random_dit(run), random_vae(run)
    weights = tensor_bytes(dit) + tensor_bytes(vae)
    models = Models(dit, vae, dit.embedded_text_embeddings["pos"], run.device, run.device,
                    scale.dtype)
    budget = mem.Budget(dit.config, vae.config, mem.Weights.of_module(dit),
                        mem.Weights.of_module(vae))
    for size, tiled in TRACE_CELLS:
        h, w = scale.sizes[size]
        opts, setting = _trace_options(run, h, tiled), "VAE tiles" if tiled else "untiled"
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = memory_trace.build_models(dit.config, vae.config, str(run.device), scale.dtype)
            traced = memory_trace.trace_phases(fake, opts, (h, w), (h // 2, w // 2),
                                               str(run.device))
            del fake  # (on a fake GPU its tensors would count as the run's)
        estimate = memory_trace.estimate_phases(budget, opts, (h, w), mem.Placement(
            str(run.device), str(run.device)), str(run.device))
        phase, peaks = _allocator_peaks(run, weights)
        with torch.inference_mode():
            memory_trace.run_phases(models, opts, (h, w), (h // 2, w // 2), phase)
        for name, (allocated, reserved) in peaks.items():
            what = "allocated" if run.cuda else "live tensor bytes (CPU: no allocator)"
            note = (f"reserved {gib(reserved)}; " if reserved is not None else "") + (
                f"trace {gib(weights + traced[name])} (weights {gib(weights)}); budget "
                f"{gib(estimate[name])} + {gib(mem.fixed_overhead(str(run.device)))} allowance")
            measure(run.report, "trace", f"3B {scale.label(size)} x {scale.frames}, {setting}, "
                    f"{name}", lambda a=allocated, n=note, w=what: (f"{gib(a)} {w}", n))


def check_mfu(run: Run):
    scale, r = run.scale, run.report
    dit = random_dit(run)
    name = torch.cuda.get_device_name(run.device) if run.cuda else "cpu"
    peak = bf16_peak(name) if run.cuda else None
    n = scale.matmul
    a, b = (torch.randn(n, n, device=run.device, dtype=scale.dtype) for _ in range(2))
    matmul = 2 * n ** 3 / run.time(lambda: a @ b, 5)
    del a, b
    r.add("mfu", f"dense matmul {n}^2 {str(scale.dtype).removeprefix('torch.')}",
          f"{matmul / 1e12:.3f} TFLOP/s",
          f"data-sheet peak {peak / 1e12:.0f} TFLOP/s" if peak else
          "no data-sheet peak for this device: MFU is against this measured rate")
    for size in scale.sizes:
        def forward_row(size=size):
            inputs, thw = dit_inputs(run, size, dit.config.txt_in_dim)
            with torch.inference_mode():
                seconds = run.time(lambda: dit(*inputs))
            rate = count_flops(dit, thw, TEXT_TOKENS) / seconds
            mfu = f"MFU {rate / peak:.1%}" if peak else "MFU n/a (no data-sheet peak)"
            return (f"{seconds * 1e3:.1f} ms", f"{rate / 1e12:.3f} TFLOP/s, {mfu}, "
                    f"{rate / matmul:.0%} of the measured matmul rate, latent {thw}")
        measure(r, "mfu", f"3B DiT forward {scale.label(size)} x {scale.frames}", forward_row)

    def kernel_row():
        inputs, _ = dit_inputs(run, "1080p", dit.config.txt_in_dim)
        with torch.inference_mode():
            return attention_kernel(run, lambda: dit(*inputs))
    measure(r, "mfu", f"attention kernel used, 3B forward {scale.label('1080p')}", kernel_row)

    def syncs_3b():
        inputs, _ = dit_inputs(run, "720p", dit.config.txt_in_dim)
        with torch.inference_mode():
            dit(*inputs)  # warm: window layouts are built and kept
            return host_syncs(run, lambda: dit(*inputs))
    measure(r, "mfu", f"host syncs, 3B forward {scale.label('720p')}", syncs_3b)
    del dit
    run.free()

    def syncs_7b():
        short = random_dit(run, scale.dit7b)
        inputs, _ = dit_inputs(run, "720p", short.config.txt_in_dim)
        with torch.inference_mode():
            short(*inputs)
            value, note = host_syncs(run, lambda: short(*inputs))
        return value, note + "; 0 expected: window extents are host facts"
    measure(r, "mfu", f"host syncs, 7B forward {scale.label('720p')}, {SHORT_7B_BLOCKS} blocks",
            syncs_7b)


def swap_bytes(dit, blocks: int) -> tuple[int, int]:
    """(bytes resident on the device with the first ``blocks`` DiT blocks swapped, two of them
    in flight; bytes copied to it per forward), as the budget counts them: blocks differ in
    size (a 3B's video-only blocks are half its others)."""
    from seedvr2.memory import budget as mem

    weights = mem.Weights.of_module(dit)
    return weights.resident(blocks), sum(weights.blocks[:blocks])


def check_blockswap(run: Run):
    from seedvr2.memory.blockswap import BlockSwap, SwapRuntime

    scale, r = run.scale, run.report
    host = torch.device("cpu")
    dit = random_dit(run).to(host)
    run.free()
    inputs, _ = dit_inputs(run, "720p", dit.config.txt_in_dim)
    total = tensor_bytes(dit)
    base = {}
    for blocks in scale.swaps:
        def swap_row(blocks=blocks):
            swap = None
            try:
                if blocks:
                    # On the CPU BlockSwap is inactive unless forced (it only pays on CUDA);
                    # the rehearsal forces it to run the same hooks and arena.
                    swap = BlockSwap(dit, blocks, False, run.device, host,
                                     runtime=SwapRuntime(force=not run.cuda))
                else:
                    dit.to(run.device)
                run.reset_peaks()
                with torch.inference_mode():
                    seconds = run.time(lambda: dit(*inputs), 2)
                    prof = _profile(run, lambda: dit(*inputs))
                base.setdefault("seconds", seconds)
                peaks = run.peaks()
                resident, moved = swap_bytes(dit, blocks)
                if blocks:
                    note = [f"{peaks}; resident weights + 2 blocks in flight = {gib(resident)} "
                            f"(all weights {gib(total)}, swapped {gib(moved)})"]
                else:
                    note = [f"{peaks}; all weights resident = {gib(total)}"]
                if swap is not None:
                    most = getattr(swap.schedule, "max_resident", "n/a")
                    note.append(f"swapped blocks resident at most: {most} (schedule)")
                    if run.fake is not None:  # (the profiler sees no fake copy)
                        note.append(f"H2D {gib(moved)} per forward in {FAKE_NUMBER}")
                    elif run.cuda:
                        copy_s, overlap = copy_overlap(prof)
                        note.append(f"H2D {gib(moved)} per forward in {copy_s * 1e3:.0f} ms = "
                                    f"{moved / copy_s / 1e9 if copy_s else float('nan'):.1f} GB/s, "
                                    f"{overlap:.0%} overlapping kernels")
                    else:
                        views = [t for b in dit.blocks[:blocks] for t in b.parameters()]
                        copies = [torch.empty_like(v) for v in views]
                        copy_s = run.time(lambda: [c.copy_(v) for c, v in zip(copies, views)], 2)
                        note.append(f"host memcpy of the swapped {gib(moved)} = "
                                    f"{moved / copy_s / 1e9:.1f} GB/s (CPU analogue of the H2D "
                                    f"copies; overlap: CUDA only)")
                    note.append(f"arena pinned {gib(swap.pinned_bytes)} "
                                f"({'cudaHostRegister' if run.cuda else 'CPU: nothing to pin'})")
                return (f"{seconds * 1e3:.1f} ms ({seconds / base['seconds']:.2f}x)",
                        "; ".join(note))
            finally:
                if swap is not None:
                    swap.leave()
                dit.to(host)
                del swap
                run.free()
        measure(r, "blockswap", f"{blocks} of {scale.blocks_3b} blocks swapped, 3B forward "
                f"{scale.label('720p')} x {scale.frames}", swap_row)


VAE_COMBOS = ((False, False), (True, False), (False, True), (True, True))


def check_vae(run: Run):
    from seedvr2.memory import tiling
    from seedvr2.options import resolve_options

    scale, r = run.scale, run.report
    vae = random_vae(run)
    h, w = scale.sizes["1080p"]
    video = torch.rand(1, 3, scale.frames, h, w, device=run.device).mul_(2).sub_(1).to(scale.dtype)
    latent = torch.randn(1, 16, (scale.frames - 1) // 4 + 1, h // 8, w // 8, device=run.device,
                         dtype=scale.dtype)
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    cudnn_note = "" if run.cuda else " (CPU: cuDNN unused, flag set only)"
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # "off" means off, whatever the process had
    try:
        for benchmark, channels_last in VAE_COMBOS:
            opts = resolve_options(vae_cudnn_benchmark=benchmark, vae_channels_last=channels_last)
            vae.set_conv_settings(cudnn_benchmark=opts.vae_cudnn_benchmark,
                                  paths=VaePaths(channels_last=opts.vae_channels_last))
            for stage in ("encode", "decode"):
                tiles, slices = tiling.settings_from_options(opts, stage)
                work = (lambda: tiling.encode_posterior(vae, video, tiles, slices)) \
                    if stage == "encode" else (lambda: tiling.decode(vae, latent, tiles, slices))

                def vae_row(work=work, slices=slices):
                    run.free()
                    run.reset_peaks()
                    with torch.inference_mode():
                        seconds = run.time(work, 1)  # the warm-up run does cuDNN's autotuning
                    return (f"{seconds:.3f} s", f"{run.peaks()}; temporal slices of {slices} "
                            f"frames (the default), untiled{cudnn_note}")
                measure(r, "vae", f"{stage} {scale.label('1080p')} x {scale.frames}, "
                        f"cudnn.benchmark {on(benchmark)}, channels_last_3d {on(channels_last)}",
                        vae_row)
        vae.set_conv_settings(cudnn_benchmark=False)
        tiles, slices = tiling.settings_from_options(resolve_options(), "decode")

        def decode_syncs():
            with torch.inference_mode():
                return host_syncs(run, lambda: tiling.decode(vae, latent, tiles, slices))
        measure(r, "vae", f"host syncs, decode {scale.label('1080p')} x {scale.frames}",
                decode_syncs)
    finally:
        torch.backends.cudnn.benchmark = before


def _random_packed(fmt: str, shape: tuple, device: torch.device):
    """A PackedWeight of ``shape`` in ``fmt`` with random contents and finite scales (the
    dequantisers' speed does not depend on the values)."""
    from seedvr2.loading.gguf import BLOCK_SIZES
    from seedvr2.loading.fp8 import quantize_fp8
    from seedvr2.loading.packed_layers import PackedWeight

    if fmt.startswith("float8"):
        data, scale = quantize_fp8(torch.randn(shape, device=device) * 0.02, getattr(torch, fmt))
        return PackedWeight("float", tuple(shape), {"data": data, "scale": scale})
    values, block_bytes = BLOCK_SIZES[fmt]
    n = -(-math.prod(shape) // values)
    blocks = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, device=device)
    # fp16 scales at the front of each block: d (Q8_0); d and dmin (Q4_K)
    for offset in ((0,) if fmt == "Q8_0" else (0, 2)):
        blocks[:, offset:offset + 2] = torch.full((n, 1), 0.01, dtype=torch.float16,
                                                  device=device).view(torch.uint8)
    return PackedWeight("gguf", (n * values,), {"blocks": blocks}, {"qtype": fmt})


def check_dequant(run: Run):
    from seedvr2.loading.lowp import compute_path
    from seedvr2.loading.packed_layers import can_pack

    scale = run.scale
    with torch.device("meta"):
        dit = build_dit(scale.dit3b)
    shapes = collections.Counter(tuple(m.weight.shape) for m in dit.modules()
                                 if can_pack(m, "weight") and m.weight is not None)
    values = sum(math.prod(s) * c for s, c in shapes.items())
    for fmt in ("Q8_0", "Q4_K", "float8_e4m3fn"):
        def dequant_row(fmt=fmt):
            seconds, fp8_matmul = 0.0, 0
            for shape, count in shapes.items():
                packed = _random_packed(fmt, shape, run.device)
                seconds += count * run.time(lambda: packed.dequantize(scale.dtype))
                if len(shape) == 2 and compute_path(packed, scale.dtype, run.device,
                                                    "auto") == "fp8":
                    fp8_matmul += count
                del packed
            note = (f"{sum(shapes.values())} packable weights, {values / 1e9:.3f} G values "
                    f"({len(shapes)} shapes timed, best of {scale.repeats}), "
                    f"{values * scale.dtype.itemsize / seconds / 1e9:.0f} GB/s written")
            if fmt.startswith("float8"):
                note += (f"; with compute_precision auto, {fp8_matmul} of them multiply in "
                         f"fp8 (torch._scaled_mm) instead (no dequant)" if run.cuda
                         else "; fp8 products: CUDA only (see the lowp section)")
            return f"{seconds * 1e3:.2f} ms per forward", note
        measure(run.report, "dequant", f"{fmt} -> {str(scale.dtype).removeprefix('torch.')}, "
                f"every packable 3B weight{'' if scale.name == 'GPU' else ' (tiny stand-in)'}",
                dequant_row)


LOWP_FORMATS = ("int8", "int8_convrot", "fp8_e4m3fn", "mxfp8", "nvfp4")
PATH_OF = {"int8": "int8", "int8_convrot": "int8", "fp8_e4m3fn": "fp8", "mxfp8": "mxfp8",
           "nvfp4": "nvfp4", "bf16": "weights"}
KITCHEN_WHEEL = ("comfy-kitchen is not installed here: pip install seedvr2-comfyui[kitchen]; "
                 "for the GPU machine see bench/gpu_checks.sh (the wheel without its ROCm "
                 "kernels, 37 MB, travels in .whl)")



def lowp_stand_in(run: Run, capability):
    """What the lowp section's checked pass runs under: every kernel call checked against its
    preconditions and the quantisers' calls recorded (tests/kernel_checks.py); each layer's
    product checked against ``dequant(quant(x)) @ dequant(W).T`` where there are values (not
    on a fake GPU). On the CPU through the stand-in for a GPU of ``capability`` (block-scaled
    matmuls by their definition); on a GPU, real or fake, through its own kernels."""
    from kernel_checks import KernelLog, capable_gpu, checked_kernels, checked_products
    from seedvr2.kernels import platform_of

    if not run.cuda and capability is not None:
        return capable_gpu(capability)
    log = KernelLog(platform_of(run.device))
    return _stacked(checked_kernels(log, stand_ins=False),
                    checked_products(log, compare=run.fake is None))


@contextlib.contextmanager
def _stacked(outer, inner):
    """Both contexts, the inner one's value."""
    with outer, inner as value:
        yield value


def _quantised_dit(run: Run, target: str):
    """The lowp section's random 3B (same seed, so the same weights every call) in bf16, its
    block linears packed in ``target`` as ``seedvr2 quantize`` writes them."""
    from seedvr2.loading.quantize import pack_weight, should_quantize
    from seedvr2.loading.packed_layers import attach_packed_weight

    torch.manual_seed(1)
    dit = random_model(build_dit, run.scale.dit3b, run.device, torch.bfloat16)
    dit.set_attention_backend("auto")
    if target == "bf16":
        return dit
    for name, module in list(dit.named_modules()):
        if isinstance(module, torch.nn.Linear) and should_quantize(name + ".weight",
                                                                   module.weight.shape):
            packed = pack_weight(module.weight, target)
            if packed is not None:
                attach_packed_weight(module, packed, torch.bfloat16, name)
    return dit


def check_lowp(run: Run):
    """3B DiT forward at 1080p x 21 per weight format and compute_precision: time, peak
    memory and the output's relative L2 difference from the bf16 model's; and per format and
    capability one line ``lowp FORMAT capability X.Y: N layers on the kernel, M dequantised,
    failed F``. Rehearsed capabilities whose dispatch takes the same path for every layer as
    one already run share its measurement (the kernel calls and their checks are the same)."""
    scale, r = run.scale, run.report
    if not _installed("comfy_kitchen"):
        r.add("lowp", "(section)", "skipped", KITCHEN_WHEEL)
        return
    inputs, _ = dit_inputs(run, "1080p", scale.dit3b.txt_in_dim)
    inputs = tuple(t.bfloat16() if t.is_floating_point() and t.dim() == 2 else t for t in inputs)
    capabilities = [tuple(torch.cuda.get_device_capability(run.device))] if run.cuda \
        else run.capabilities
    reference = {}
    with torch.inference_mode():
        for target in ("bf16",) + LOWP_FORMATS:
            dit = _quantised_dit(run, target)
            measured = {}  # the layers' paths -> (value, note) of the row that ran them
            for precision in ("weights",) if target == "bf16" else ("weights", "auto"):
                for capability in capabilities if precision == "auto" else [None]:
                    _lowp_row(run, dit, target, precision, capability, inputs, reference,
                              measured)
            del dit
            if run.cuda:  # (a collection per format costs the CPU rehearsal seconds)
                run.free()


def _layer_paths(run: Run, dit, capability) -> tuple:
    from seedvr2.loading.lowp import compute_path
    from seedvr2.loading.packed_layers import packed_modules

    with lowp_stand_in(run, capability):
        return tuple(compute_path(p, torch.bfloat16, run.device, "auto")
                     for p in packed_modules(dit).values())


def _lowp_row(run: Run, dit, target, precision, capability, inputs, reference, measured):
    from seedvr2.loading.packed_layers import packed_modules, set_compute_precision

    set_compute_precision(dit, precision)
    scale = run.scale
    label = "bf16 weights" if target == "bf16" else f"{target}, compute_precision={precision}"
    if capability is not None and not run.cuda:
        label += f", capability {capability[0]}.{capability[1]} stand-in"
    paths = _layer_paths(run, dit, capability) if precision == "auto" else None

    def row():
        if paths in measured:
            seconds, diff, kernel, failed, checked, first = measured[paths]
            shared = f"; the same paths as {first}: not run again"
        else:
            seconds, diff, kernel, failed, checked = _lowp_forward(run, dit, capability, inputs,
                                                                   reference)
            shared = ""
            if paths is not None:
                measured[paths] = (seconds, diff, kernel, failed, checked,
                                   f"capability {capability[0]}.{capability[1]}")
        packed = len(packed_modules(dit))
        ways = ([f"{kernel} {PATH_OF[target]}"] if kernel else []) + \
            ([f"{packed - kernel} weights"] if packed > kernel else [])
        note = (f"{run.peaks()}; relative L2 difference from bf16 {diff:.2e}; packed linears "
                f"by path: {', '.join(ways) or 'none'}{shared}")
        if precision == "auto":
            name = "fp8" if target.startswith("fp8") else target
            line = (f"lowp {name} capability {capability[0]}.{capability[1]}: {kernel} layers on "
                    f"the kernel, {packed - kernel} dequantised, failed {failed} "
                    f"(relative L2 difference from bf16 {diff:.2e})")
            line = run.add_line(line)
            print(line, file=sys.stderr, flush=True)
            note += f"; {line}" + (f"; {checked}" if checked else "")
            if run.fake is not None:
                _fallbacks_fail(run, dit, line, paths, kernel, failed)
        return f"{seconds:.3f} s", note
    measure(run.report, "lowp", f"3B forward {scale.label('1080p')} x {scale.frames}, {label}", row)


def _fallbacks_fail(run: Run, dit, line: str, paths: tuple, kernel: int, failed: int):
    """On the fake GPU a layer off the kernel its capability has is a failure of the run."""
    expected = sum(path != "weights" for path in paths)
    if failed or kernel != expected:
        why = next((m._lowp_failure for m in dit.modules()
                    if getattr(m, "_lowp_failure", None) is not None), None)
        run.fake.violations.append(f"{line.split(' (relative')[0]}, where {expected} layers have "
                                   f"a kernel" + (f" (first failure: {why})"[:300] if why else ""))


def _lowp_forward(run: Run, dit, capability, inputs, reference):
    """(seconds, difference from bf16, layers on the kernel, layers failed, the failed
    check's message or None) of one forward. On a GPU the checked pass comes first, then an
    unchecked pass is timed and measured (the checks' float32 products and host reads would
    count in both); the CPU rehearsal times its one checked pass."""
    out, checked, seconds = [], None, float("nan")
    run.reset_peaks()
    with lowp_stand_in(run, capability) as log:
        try:
            start = time.perf_counter()
            out.append(dit(*inputs).float())
            seconds = time.perf_counter() - start
        except KernelCheckFailed as e:
            checked = str(e)
    if run.fake is not None:
        seconds = float("nan")  # (the fake tensors' time is no GPU's)
    # (On a fake GPU the checked pass allocates what the unchecked one does: no values to
    # compare; its peaks stand.)
    if run.cuda and run.fake is None and checked is None:
        run.free()
        run.reset_peaks()
        out[:] = []
        seconds = run.time(lambda: out.append(dit(*inputs).float()), 1)
    failed = sum(getattr(m, "_lowp_failure", None) is not None for m in dit.modules()) + \
        (checked is not None)
    diff = float("nan")
    if out and run.fake is None:
        reference.setdefault("bf16", out[-1])
        diff = ((out[-1] - reference["bf16"]).norm() / reference["bf16"].norm()).item()
    return seconds, diff, len(log.layers), failed, checked


def check_room(run: Run):
    """The automatic batch size beside a resident model that leaves the device all but
    ROOM_LEFT free and goes only when asked: what ComfyUI's idle models do under dynamic VRAM."""
    from seedvr2.api import load_models, prepare_job
    from seedvr2.memory import budget as mem
    from seedvr2.options import resolve_options

    scale = run.scale
    opts = resolve_options(device=str(run.device), resolution=scale.e2e_resolution,
                           batch_size="auto", dtype=scale.dtype_option)
    models = load_models(random_dit(run), random_vae(run), opts=opts)
    size, frames = scale.sizes["1080p"], 121
    auto = lambda make_room=None: prepare_job(models, opts, frames, size, None,  # noqa: E731
                                              make_room).batch_size
    measure(run.report, "room", "auto batch, device empty", lambda: (f"{auto()} frames", ""))
    free = mem.device_available(run.device) or 0
    resident = [torch.empty(max(free - ROOM_LEFT, 0) if run.cuda else REHEARSAL_RESIDENT,
                            dtype=torch.uint8, device=run.device)]
    held = gib(resident[0].numel())
    asked = []

    def make_room(device: str, need: int):  # ComfyUI's free_memory: unload until need is free
        asked.append(need)
        resident.clear()
        run.free()

    def crowded():
        try:
            return f"{auto()} frames", f"a resident model of {held}, not asked to leave"
        except mem.BudgetError as e:
            return "0 frames", f"refused: {e}"[:300]
    measure(run.report, "room", "auto batch, resident model, no request", crowded)
    measure(run.report, "room", "auto batch, resident model, job asks for room",
            lambda: (f"{auto(make_room)} frames",
                     f"asked for {', '.join(gib(n) for n in asked)}; resident {held} freed"))


ROOM_LEFT = 1 << 30  # what the resident model leaves free on the GPU
REHEARSAL_RESIDENT = 64 << 20  # the rehearsal's stand-in (host RAM is what the CPU measures)


VAE_PATHS = ("today", "channels_last", "fused_norm", "fp16_accumulation", "int8_cache")



def _vae_path_table(run: Run) -> dict:
    """Each vae_paths row's paths: that path alone, as ``choose_paths`` allows it here (where it
    cannot run, today's, with the reason in the row's note)."""
    from seedvr2.models.vae_paths import TODAY, choose_paths

    allowed = choose_paths(run.device, torch.float16, fp16_accumulation=True,
                           int8_cache_bytes=run.scale.int8_cache_bytes, cache_offload=run.cuda)
    return {"today": TODAY, "channels_last": VaePaths(channels_last=True),
            "fused_norm": VaePaths(fused_norm=allowed.fused_norm),
            "fp16_accumulation": VaePaths(fp16_accumulation=allowed.fp16_accumulation),
            "int8_cache": VaePaths(int8_cache_bytes=allowed.int8_cache_bytes,
                                   cache_offload=allowed.cache_offload)}


def check_vae_paths(run: Run):
    """Encode + decode per VAE kernel path (module doc); on the CPU through the stand-in for a
    GPU of the highest ``--capability`` (comfy-kitchen's eager backend, every kernel call
    checked against its preconditions)."""
    from seedvr2.memory import tiling
    from seedvr2.options import resolve_options

    scale = run.scale
    vae = random_model(build_vae, scale.vae, run.device, torch.float16)
    frames, h, w = scale.paths_clip
    torch.manual_seed(5)
    video = torch.rand(1, 3, frames, h, w, device=run.device).mul_(2).sub_(1).half()
    opts = resolve_options()
    (enc_tiles, enc_slices), (dec_tiles, dec_slices) = (
        tiling.settings_from_options(opts, stage) for stage in ("encode", "decode"))
    stand_in = vae_stand_in(run, max(run.capabilities)) if _installed("comfy_kitchen") else \
        contextlib.nullcontext()
    decoded = {}
    with stand_in, torch.inference_mode():
        table = _vae_path_table(run)
        for name in VAE_PATHS:
            def work(paths=table[name], name=name):
                vae.set_conv_settings(cudnn_benchmark=False, paths=paths)
                latent = tiling.encode(vae, video, enc_tiles, enc_slices)
                # A copy on the host: kept on the GPU, each video would count in later rows' peaks
                decoded[name] = tiling.decode(vae, latent, dec_tiles, dec_slices).cpu()

            def row(name=name, work=work):
                return _vae_paths_row(run, name, work, decoded, table[name])
            measure(run.report, "vae_paths", f"{name}: encode + decode {h}x{w} x {frames}, "
                    f"fp16", row)
    vae.set_conv_settings(cudnn_benchmark=False)


def vae_stand_in(run: Run, capability):
    """Every kernel call of the VAE checked against its preconditions: on the CPU through the
    stand-in for a GPU of ``capability``, on a GPU (real or fake) through its own kernels."""
    from kernel_checks import WRAPPED, KernelLog, capable_gpu, checked_kernels
    from seedvr2.kernels import platform_of

    if run.cuda:
        # Not attention: the VAE's one head of 512 channels is over the fused kernels' 256, so
        # PyTorch runs it on its math kernel, which the VAE plans for (ATTENTION_SCORE_BUDGET).
        vae_kernels = tuple(w for w in WRAPPED if "scaled_dot_product_attention" not in w.kernel)
        return checked_kernels(KernelLog(platform_of(run.device)), vae_kernels, stand_ins=False)
    return capable_gpu(capability, check_products=False)


def _vae_paths_row(run: Run, name: str, work, decoded: dict, paths) -> tuple:
    run.free()
    run.reset_peaks()
    if run.cuda:
        seconds = run.time(work, 1)
        peak = torch.cuda.max_memory_allocated(run.device)
    else:  # one run (the rehearsal shows the row works, it times nothing worth a repeat)
        import memory_trace

        started = time.perf_counter()
        with memory_trace.LiveBytes(str(run.device)) as live:
            work()
        seconds, peak = time.perf_counter() - started, live.peak
    error = float("nan") if run.fake is not None else \
        (decoded[name].float() - decoded["today"].float()).square().mean().item()
    psnr = "inf" if error == 0 else f"{10 * math.log10(4 / error):.1f}"  # range [-1, 1]
    line = (f"vae_paths {name}: time {seconds:.3f} s, peak {peak / 2 ** 30:.3g} GiB, "
            f"PSNR {psnr} dB vs today")
    run.add_line(line)
    fell_back = name != "today" and paths == VaePaths()
    how = ("today's path: comfy-kitchen or this GPU cannot run it" if fell_back
           else paths.describe())
    return f"{seconds:.3f} s", f"{line.split(', ', 1)[1]}; {how}"


CHECKS = {"env": check_env, "e2e": check_e2e, "trace": check_trace, "mfu": check_mfu,
          "blockswap": check_blockswap, "vae": check_vae, "dequant": check_dequant,
          "room": check_room, "lowp": check_lowp, "vae_paths": check_vae_paths}


# -- the command -----------------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="bench/gpu_checks.sh", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rehearse", action="store_true",
                        help="every section on the CPU with tiny models at small sizes")
    parser.add_argument("--fake-cuda", action="store_true",
                        help="with --rehearse: the GPU run's own branch at real sizes on a fake "
                             "cuda:0 of each --capability (fake tensors; default 9.0)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no section after this many minutes (default 8; 15 per "
                             "capability with --fake-cuda)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--device", default="cuda:0", help="the GPU to measure (default cuda:0)")
    parser.add_argument("--capability", default=None, metavar="X.Y[,X.Y...]",
                        help="with --rehearse: the compute capabilities whose paths the lowp "
                             "section (vae_paths: the highest) takes on the CPU, every kernel "
                             "call checked against its preconditions (default 12.0)")
    args = parser.parse_args(argv)
    if args.fake_cuda and not args.rehearse:
        raise UsageError("--fake-cuda rehearses a GPU run on the CPU: give it with --rehearse")
    args.capability = _capabilities(args.capability or ("9.0" if args.fake_cuda else "12.0"))
    if args.minutes is None:
        args.minutes = 15.0 if args.fake_cuda else 8.0
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise UsageError(f"--sections {args.sections!r}: unknown section(s) "
                         f"{', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SECTIONS)}")
    if not (0 < args.minutes <= 60):
        raise UsageError(f"--minutes {args.minutes}: give a time between 0 and 60 minutes")
    args.sections = [s for s in SECTIONS if s in chosen]  # always in order of value
    if not args.rehearse:
        if not torch.cuda.is_available():
            raise UsageError("no CUDA device here: these checks measure a GPU. Use --rehearse "
                             "to run every section on the CPU at small sizes")
        device = torch.device(args.device)
        if device.type != "cuda" or (device.index or 0) >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: not a CUDA device of this machine "
                             f"({torch.cuda.device_count()} visible)")
    return args


def _capabilities(text: str) -> tuple:
    found = []
    for part in text.split(","):
        major, dot, minor = part.strip().partition(".")
        if not (major.isdigit() and minor.isdigit() and dot) or not 1 <= int(major) <= 20:
            raise UsageError(f"--capability {text!r}: give compute capabilities as X.Y, "
                             f"comma-separated (e.g. 7.5,8.9,12.0)")
        found.append((int(major), int(minor)))
    return tuple(found)


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"gpu_checks: {e}", file=sys.stderr)
        return 2
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    if args.fake_cuda:
        return _fake_cuda_runs(args, out, started)
    caps = dict.fromkeys(SECTIONS, REHEARSE_CAP) if args.rehearse else CAPS
    if args.rehearse:
        device, scale = torch.device("cpu"), rehearse_scale()
    else:
        device, scale = torch.device(args.device), full_scale()
        torch.cuda.set_device(device)
    report = Report(out, f"GPU checks ({scale.name}, {device}), started {started}")
    run = Run(device, scale, report, args.capability)
    run_sections(run, args, caps)
    for line in run.lines:
        print(line)
    print(report.markdown())
    return 0


def _fake_cuda_runs(args, out: Optional[Path], started: str) -> int:
    """The GPU run's sections at real sizes on a fake cuda:0 of each capability in turn
    (tests/fake_cuda.py); 1 when anything a GPU would refuse happened."""
    from fake_cuda import fake_cuda

    report = Report(out, f"GPU checks (fake cuda: {', '.join(map(_dotted, args.capability))}), "
                    f"started {started}", fake=True)
    lines, failed = [], False
    for capability in args.capability:
        with fake_cuda(capability) as gpu:
            run = Run(torch.device("cuda", 0), full_scale(), report, (capability,), fake=gpu)
            failed |= not run_sections(run, args, dict.fromkeys(SECTIONS, FAKE_CUDA_CAP))
        lines += run.lines
    for line in lines:
        print(line)
    print(report.markdown())
    return 1 if failed else 0


def _dotted(capability) -> str:
    return f"{capability[0]}.{capability[1]}"


def run_sections(run: Run, args, caps: dict) -> bool:
    """Every chosen section in order, each within its cap (seconds, ``caps``); False when the
    fake GPU saw something a GPU would refuse (the section's row ``checks`` names it)."""
    report, ok = run.report, True
    torch.manual_seed(0)
    deadline = time.monotonic() + args.minutes * 60
    for name in args.sections:
        left = deadline - time.monotonic()
        cap = min(caps[name], left)
        if cap < MIN_SECTION_SECONDS:
            report.add(name, "(not started)", "skipped", f"past the {args.minutes:g}-minute limit")
            continue
        rows, began = len(report.rows), time.monotonic()
        try:
            with time_cap(cap):
                CHECKS[name](run)
        except SectionTimeout:
            report.add(name, "(rest of the section)", "skipped", f"stopped at its {cap:.0f} s cap")
        except ModuleNotFoundError as e:
            report.add(name, "(section)", "skipped", f"needs {e.name}, which is not installed here")
        except (Exception, KernelCheckFailed) as e:  # noqa: BLE001 -- the table is the product
            traceback.print_exc()  # on stderr, with the progress: where it failed
            report.add(name, "(section)", "error", f"{type(e).__name__}: {e}"[:400])
        if len(report.rows) == rows:
            report.add(name, "(section)", "error", "measured nothing")
        run.free()
        if run.fake is not None:
            ok &= _fake_checks(run, name, report.rows[rows:], time.monotonic() - began)
    return ok


def _fake_checks(run: Run, section: str, rows: list, wall: float) -> bool:
    """The section's row ``checks`` on the fake GPU: FAILED naming what a GPU would refuse
    (tests/fake_cuda.py's violations) and the rows in error, else passed; with its wall time."""
    seen = [f"{v} (x{n})" if n > 1 else v
            for v, n in collections.Counter(run.fake.violations).most_common(8)]
    seen += [f"row '{what}' {value}" for _, what, value, _ in rows
             if value in ("error", "FAILED")]
    run.fake.violations.clear()
    run.report.add(section, "checks", "FAILED" if seen else "passed",
                   f"wall {wall:.1f} s on this CPU" + "".join(f"; {v}" for v in seen))
    return not seen


if __name__ == "__main__":
    sys.exit(main())
