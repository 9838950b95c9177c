"""The GPU checks of issue 12 in one run (about 8 minutes on one H200), one summary table.

Random weights of the real shapes (3B DiT, the released VAE), nothing downloaded:

* dtype     what ``dtype=auto`` chose for this GPU, and its compute capability
* blockswap 3B forward at 720p x 21 with 0 / 16 / 32 blocks swapped: time, peak allocated,
            pinned host bytes, and how much of the host->device copy time overlaps kernels
            in a profiler trace (BlockSwap prefetches on a side stream: should be most of it)
* mfu       3B forward at 720p and 1080p x 21: model FLOP utilisation against the GPU's
            dense bf16 peak (FLOPs counted from the real windows), and the stream syncs one
            forward makes (torch.cuda.set_sync_debug_mode counts them)
* vae       VAE decode of 1080p x 21, untiled and in 512-px tiles: time and peak
* e2e       ``seedvr2.upscale`` of a synthetic 21-frame clip to 1080p, untiled and with 512-px
            tiles: frames/s, and the memory budget's estimate next to the measured per-phase
            peaks (budget vs. reality: the budget is uncalibrated until this runs)

Each section stops being started once ``--minutes`` have passed; its rows then say so.
``--dry-run`` builds everything on ``meta`` (no GPU needed, nothing computed), runs the DiT
forward there to prove the shapes, and prints the plan.

    bench/gpu_checks.sh [--dry-run] [--minutes 8] [--sections dtype,blockswap,mfu,vae,e2e]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, bench/dit_forward.py

from common import best_time  # noqa: E402
from dit_forward import count_flops  # noqa: E402

from seedvr2.models import build_dit, build_vae, dit_config, vae_config  # noqa: E402
from seedvr2.models.config import shipped_config  # noqa: E402
from seedvr2.models.rope import FrequencyTable, _RoPE3d  # noqa: E402

SECTIONS = ("dtype", "blockswap", "mfu", "vae", "e2e")
TEXT_TOKENS = 58
# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' data sheets; a GPU not
# listed gets "n/a" for MFU and its measured matmul rate instead.
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "RTX 4090": 165e12}
# Output sizes (H, W) of the checks: latent = /8, DiT tokens = latent / (1, 2, 2).
SIZES = {"720p": (720, 1280), "1080p": (1088, 1920)}  # 1080 rounds up to 16-px multiples
FRAMES = 21


class UsageError(ValueError):
    pass


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="bench/gpu_checks.sh", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="build everything on meta and print the plan (no GPU needed)")
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="start no section after this many minutes (default 8)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--device", default="cuda:0", help="the GPU to measure (default cuda:0)")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise UsageError(f"--sections {args.sections!r}: unknown section(s) "
                         f"{', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}")
    if not (0 < args.minutes <= 60):
        raise UsageError(f"--minutes {args.minutes}: give a time between 0 and 60 minutes")
    args.sections = chosen
    if not args.dry_run:
        if not torch.cuda.is_available():
            raise UsageError("no CUDA device here: these checks measure a GPU. Use --dry-run "
                             "to check the plan on a machine without one")
        device = torch.device(args.device)
        if device.type != "cuda" or (device.index or 0) >= torch.cuda.device_count():
            raise UsageError(f"--device {args.device}: not a CUDA device of this machine "
                             f"({torch.cuda.device_count()} visible)")
    return args


@dataclass
class Report:
    rows: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def add(self, section: str, what: str, value: str, note: str = ""):
        self.rows.append((section, what, value, note))
        print(f"[{time.monotonic() - self.started:6.1f}s] {section}: {what} = {value} {note}",
              file=sys.stderr, flush=True)

    def table(self) -> str:
        header = ("section", "measurement", "value", "note")
        widths = [max(len(str(r[i])) for r in [header, *self.rows]) for i in range(4)]
        line = lambda r: " | ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        rule = "-+-".join("-" * w for w in widths)
        return "\n".join([line(header), rule, *(line(r) for r in self.rows)])


def gib(n) -> str:
    return "n/a" if n is None else f"{n / 2 ** 30:.2f} GiB"


# -- models with random weights of the real shapes ------------------------------------------------

def _restore_rope_tables(model):
    """to_empty leaves buffers uninitialised: the RoPE tables get their defining values back."""
    for module in model.modules():
        if isinstance(module, _RoPE3d):
            table: FrequencyTable = module.rope
            table.freqs = module.default_freqs(module.axis_dim).to(table.freqs.device)


def _random_weights(model, device: torch.device, dtype: torch.dtype):
    """N(0, 0.02) weights (biases 0, norm gains 1) on ``device``; ``meta`` keeps shapes only."""
    if device.type == "meta":
        return model.to(dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm gains
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.to(dtype)


def build_models(device: torch.device, dtype: torch.dtype):
    """3B DiT and VAE with random weights of the real shapes on ``device``; ``meta`` builds
    shapes only."""
    with torch.device("meta"):
        dit = build_dit(dit_config("3b")).eval()
        vae = build_vae(vae_config(shipped_config("vae"))).eval()
    dit, vae = _random_weights(dit, device, dtype), _random_weights(vae, device, dtype)
    if device.type != "meta":
        _restore_rope_tables(dit)
    dit.embedded_text_embeddings = {"pos": torch.randn(TEXT_TOKENS, dit.config.txt_in_dim)}
    return dit, vae


SHORT_7B_BLOCKS = 2  # both window rules; host syncs do not depend on the block count


def build_short_7b(device: torch.device, dtype: torch.dtype):
    """The 7B DiT's real widths and window rules with only its first blocks: enough to count
    the host syncs of its window-local RoPE and packing in a forward."""
    import dataclasses

    config = dit_config("7b")
    config = dataclasses.replace(
        config, num_layers=SHORT_7B_BLOCKS,
        **{key: getattr(config, key)[:SHORT_7B_BLOCKS]
           for key in ("block_type", "window", "window_method")})
    with torch.device("meta"):
        dit = build_dit(config).eval()
    dit = _random_weights(dit, device, dtype)
    if device.type != "meta":
        _restore_rope_tables(dit)
    return dit


def dit_inputs(size: str, device: torch.device, dtype: torch.dtype, txt_in_dim: int):
    h, w = SIZES[size]
    thw = ((FRAMES - 1) // 4 + 1, h // 8, w // 8)
    vid = torch.randn(math.prod(thw), 33, device=device, dtype=dtype) if device.type != "meta" \
        else torch.empty(math.prod(thw), 33, device=device, dtype=dtype)
    txt = torch.zeros(TEXT_TOKENS, txt_in_dim, device=device, dtype=dtype)
    # Shapes on the CPU (host facts, as the pipeline passes them); timestep filled on device.
    return (vid, txt, torch.tensor([thw]), torch.tensor([[TEXT_TOKENS]]),
            torch.full((1,), 1000.0, device=device)), thw


def budget_phases(dit, vae, tiled: bool, device: str = "cuda:0") -> dict:
    """The memory budget's estimate per phase (bytes) for the e2e job: 3B bf16, 1080p x 21,
    one batch, untiled or 512-px tiles, both models on ``device``."""
    from seedvr2.memory import budget as mem
    from seedvr2.options import resolve_options
    from seedvr2.pipeline.setup import _budget_job

    budget = mem.Budget(dit.config, vae.config, mem.Weights.of_module(dit), mem.Weights.of_module(vae))
    opts = resolve_options(batch_size=FRAMES, vae_encode_tiled=tiled, vae_decode_tiled=tiled,
                           vae_encode_tile_size=512, vae_decode_tile_size=512)
    job = _budget_job(opts, SIZES["1080p"], FRAMES, torch.bfloat16, TEXT_TOKENS, {device})
    return {p.phase.lower(): p.total for p in mem.estimate(budget, job, mem.Placement(device, device)).phases}


# -- sections -----------------------------------------------------------------------------------------

def check_dtype(report, device):
    from seedvr2.memory.policy import resolve_dtype

    chosen = resolve_dtype("auto", device)
    capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
    report.add("dtype", "dtype=auto chose", str(chosen).replace("torch.", ""),
               f"{torch.cuda.get_device_name(device)}, compute capability {capability}")


def _pinned_bytes():
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    values = stats()
    for key in ("reserved_bytes.all.current", "allocated_bytes.all.current"):
        if key in values:
            return values[key]
    return None


def _copy_overlap(prof) -> tuple[float, float]:
    """(host->device copy ms, fraction of it during kernels) from a profiler trace."""
    copies, kernels = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
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
    hidden = 0.0
    for s, t in copies:
        hidden += sum(max(0.0, min(t, b) - max(s, a)) for a, b in merged if a < t and b > s)
    return total / 1e3, (hidden / total if total else float("nan"))


def check_blockswap(report, device, dtype):
    from seedvr2.memory.blockswap import BlockSwap

    dit, _ = build_models(device, dtype)
    inputs, thw = dit_inputs("720p", device, dtype, dit.config.txt_in_dim)
    dit.to("cpu")
    torch.cuda.empty_cache()
    sync = torch.cuda.synchronize
    base = None
    for blocks in (0, 16, 32):
        swap = None
        try:
            if blocks:
                swap = BlockSwap(dit, blocks, False, device, torch.device("cpu"))
                swap.activate()
            else:
                dit.to(device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.inference_mode():
                seconds = best_time(lambda: dit(*inputs), 2, sync)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    dit(*inputs)
                    sync()
            peak = torch.cuda.max_memory_allocated(device)
            copy_ms, overlap = _copy_overlap(prof)
            base = base or seconds
            report.add("blockswap", f"{blocks} blocks swapped, 720p x {FRAMES}",
                       f"{seconds * 1e3:.0f} ms ({seconds / base:.2f}x)",
                       f"peak {gib(peak)}, pinned {gib(_pinned_bytes())}, H2D copies "
                       f"{copy_ms:.0f} ms, {overlap:.0%} overlapping kernels")
        except Exception as e:  # noqa: BLE001 -- one failing row must not lose the table
            report.add("blockswap", f"{blocks} blocks swapped", "error", f"{type(e).__name__}: {e}")
        finally:
            if swap is not None:
                swap.detach()
            dit.to("cpu")
            torch.cuda.empty_cache()


def _count_syncs(fn) -> int:
    """Stream syncs ``fn`` makes, as torch's sync debug mode reports them (one warning each)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _matmul_rate(device, dtype) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    b = torch.randn(8192, 8192, device=device, dtype=dtype)
    return 2 * 8192 ** 3 / best_time(lambda: a @ b, 5, torch.cuda.synchronize)


def check_mfu(report, device, dtype):
    dit, _ = build_models(device, dtype)
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    matmul = _matmul_rate(device, dtype)
    report.add("mfu", "dense matmul 8192^2 bf16", f"{matmul / 1e12:.0f} TFLOP/s",
               f"data-sheet peak {peak / 1e12:.0f} TFLOP/s" if peak else "no data-sheet peak known")
    for size in ("720p", "1080p"):
        try:
            inputs, thw = dit_inputs(size, device, dtype, dit.config.txt_in_dim)
            with torch.inference_mode():
                seconds = best_time(lambda: dit(*inputs), 3, torch.cuda.synchronize)
                syncs = _count_syncs(lambda: dit(*inputs))
            flops = count_flops(dit, thw, TEXT_TOKENS)
            rate = flops / seconds
            mfu = f"MFU {rate / peak:.1%}" if peak else "MFU n/a"
            report.add("mfu", f"DiT forward {size} x {FRAMES}", f"{seconds * 1e3:.0f} ms",
                       f"{rate / 1e12:.0f} TFLOP/s, {mfu}, {rate / matmul:.0%} of matmul, "
                       f"{syncs} stream syncs")
        except Exception as e:  # noqa: BLE001
            report.add("mfu", f"DiT forward {size}", "error", f"{type(e).__name__}: {e}")
    torch.cuda.empty_cache()
    try:
        short = build_short_7b(device, dtype)
        inputs, _ = dit_inputs("720p", device, dtype, short.config.txt_in_dim)
        with torch.inference_mode():
            short(*inputs)  # warm: window layouts are built and kept
            syncs = _count_syncs(lambda: short(*inputs))
        report.add("mfu", f"7B DiT forward 720p x {FRAMES}, {SHORT_7B_BLOCKS} of 36 blocks",
                   f"{syncs} stream syncs", "0 expected: window extents are host facts")
    except Exception as e:  # noqa: BLE001
        report.add("mfu", "7B DiT forward syncs", "error", f"{type(e).__name__}: {e}")


def check_vae(report, device, dtype):
    from seedvr2.memory import tiling
    from seedvr2.options import resolve_options

    _, vae = build_models(device, dtype)
    h, w = SIZES["1080p"]
    latent = torch.randn(1, 16, (FRAMES - 1) // 4 + 1, h // 8, w // 8, device=device, dtype=dtype)
    for tiled in (False, True):
        label = "512-px tiles" if tiled else "untiled"
        try:
            opts = resolve_options(vae_decode_tiled=tiled, vae_decode_tile_size=512)
            tiles, slices = tiling.settings_from_options(opts, "decode")
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            with torch.inference_mode():
                seconds = best_time(lambda: tiling.decode(vae, latent, tiles, slices), 1,
                                    torch.cuda.synchronize)
            report.add("vae", f"decode 1080p x {FRAMES}, {label}", f"{seconds:.2f} s",
                       f"peak {gib(torch.cuda.max_memory_allocated(device))}")
        except Exception as e:  # noqa: BLE001
            report.add("vae", f"decode {label}", "error", f"{type(e).__name__}: {e}")


def check_e2e(report, device, dtype):
    import seedvr2
    from seedvr2.pipeline.runner import JobStats

    dit, vae = build_models(device, dtype)
    # A synthetic 540p clip (moving gradients) upscaled to 1080p: the DiT sees 1088 x 1920.
    t = torch.arange(FRAMES, dtype=torch.float32)[:, None, None, None]
    y = torch.linspace(0, 1, 540)[None, :, None, None]
    x = torch.linspace(0, 1, 960)[None, None, :, None]
    clip = ((x + y + t / FRAMES + torch.tensor([0.0, 0.33, 0.66])) % 1.0).contiguous()
    for tiled in (False, True):
        label = "512-px tiles" if tiled else "untiled"
        try:
            stats = JobStats()
            options = dict(dit=dit, vae=vae, device=str(device), dtype="bf16", resolution=1080,
                           batch_size=FRAMES, vae_encode_tiled=tiled, vae_decode_tiled=tiled,
                           vae_encode_tile_size=512, vae_decode_tile_size=512, stats=stats)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = seedvr2.upscale(clip, **options)
            seconds = time.perf_counter() - start
            estimate = budget_phases(dit, vae, tiled, str(device))
            phases = "; ".join(f"{name} measured {gib(p.device_allocated)} / budget "
                               f"{gib(estimate.get(name))}" for name, p in stats.phases.items())
            report.add("e2e", f"3B bf16 1080p x {FRAMES}, {label}", f"{FRAMES / seconds:.2f} frames/s",
                       f"first run, loading and warm-up included; output {tuple(out.shape)}; "
                       f"peaks: {phases}")
        except Exception as e:  # noqa: BLE001
            report.add("e2e", label, "error", f"{type(e).__name__}: {e}")


# -- the dry run ------------------------------------------------------------------------------------

def dry_run(report, sections):
    """Everything built on meta: shapes, parameter counts, FLOPs, the budget's estimate, and
    the DiT forward traced on meta at both sizes (no data, no GPU)."""
    meta, dtype = torch.device("meta"), torch.bfloat16
    dit, vae = build_models(meta, dtype)
    params = sum(p.numel() for p in dit.parameters())
    report.add("plan", "3B DiT (random weights)", f"{params / 1e9:.2f} B parameters",
               f"{dit.config.num_layers} blocks, built on meta")
    report.add("plan", "VAE (random weights)", f"{sum(p.numel() for p in vae.parameters()) / 1e6:.0f} M parameters")
    if "dtype" in sections:
        report.add("dtype", "dtype=auto", "measured on the GPU", "policy.resolve_dtype('auto', cuda)")
    if "blockswap" in sections:
        report.add("blockswap", "0 / 16 / 32 blocks swapped at 720p", "measured on the GPU",
                   "time, peak allocated, pinned bytes, copy/kernel overlap (profiler)")
    for size in ("720p", "1080p"):
        inputs, thw = dit_inputs(size, meta, dtype, dit.config.txt_in_dim)
        with torch.no_grad():
            out = dit(*inputs)
        flops = count_flops(dit, thw, TEXT_TOKENS)
        if "mfu" in sections:
            report.add("mfu", f"DiT forward {size} x {FRAMES}", f"{flops / 1e12:.0f} TFLOP",
                       f"latent {thw}, output {tuple(out.shape)} (traced on meta)")
    if "mfu" in sections:
        short = build_short_7b(meta, dtype)
        inputs, _ = dit_inputs("720p", meta, dtype, short.config.txt_in_dim)
        with torch.no_grad():
            out = short(*inputs)
        report.add("mfu", f"7B DiT forward 720p x {FRAMES}, {SHORT_7B_BLOCKS} of 36 blocks",
                   "stream syncs counted on the GPU",
                   f"output {tuple(out.shape)} (traced on meta: reads nothing back)")
    if "vae" in sections:
        h, w = SIZES["1080p"]
        with torch.no_grad():
            video = vae.decode(torch.empty(1, 16, (FRAMES - 1) // 4 + 1, h // 8, w // 8,
                                           device=meta, dtype=dtype))
        report.add("vae", f"decode 1080p x {FRAMES}, untiled / 512-px tiles", "measured on the GPU",
                   f"output {tuple(video.shape)} (traced on meta)")
    if "e2e" in sections:
        for tiled in (False, True):
            phases = budget_phases(dit, vae, tiled)
            report.add("e2e", f"budget, 3B bf16 1080p x {FRAMES}, {'512-px tiles' if tiled else 'untiled'}",
                       gib(max(phases.values())),
                       "per phase: " + ", ".join(f"{k} {gib(v)}" for k, v in phases.items())
                       + "; measured on the GPU")


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"gpu_checks: {e}", file=sys.stderr)
        return 2
    report = Report()
    if args.dry_run:
        dry_run(report, args.sections)
        print(f"dry run: {len(report.rows)} rows planned; sections {', '.join(args.sections)}")
        print(report.table())
        return 0
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    device, dtype = torch.device(args.device), torch.bfloat16
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    deadline = report.started + args.minutes * 60
    checks = {"dtype": lambda: check_dtype(report, device),
              "blockswap": lambda: check_blockswap(report, device, dtype),
              "mfu": lambda: check_mfu(report, device, dtype),
              "vae": lambda: check_vae(report, device, dtype),
              "e2e": lambda: check_e2e(report, device, dtype)}
    for name in args.sections:
        if time.monotonic() > deadline:
            report.add(name, "(not started)", "skipped", f"past the {args.minutes:g}-minute limit")
            continue
        try:
            checks[name]()
        except Exception as e:  # noqa: BLE001 -- the table is the product: keep it
            report.add(name, "(section)", "error", f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    print(f"GPU checks: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"{time.monotonic() - report.started:.0f} s")
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
