"""The work of a job and the fastest a GPU could do it: FLOPs and bytes per phase at real size.

One batch runs through the pipeline's own phase functions on fake tensors at real size, set up
as ``bench/memory_trace.py`` sets up its trace (the same models, options, stand-ins; no GPU,
no weights). A dispatch mode sees every operation and counts, per phase (``encode``, ``dit``,
``decode``, ``colour``) and op class (conv3d by output width, linear, attention, norms,
elementwise):

- FLOPs: torch's formulas (``torch.utils.flop_counter``) where it has one; attention by its
  formula for the fused kernel the GPU runs (``sdpa_flop_count``); comfy-kitchen's
  ``fp16_conv3d`` as a convolution; everything else counts no FLOPs (it is bound by memory);
- bytes read and written by each op as if nothing were fused (its tensor inputs and outputs;
  views move nothing).

The time at the limit on a GPU is, per op, the larger of FLOPs / peak tensor rate (dense
bf16/fp16 with float32 accumulation, as the code's matmuls and convolutions accumulate) and
bytes / memory bandwidth, summed. Waste (work that is not the user's), as a share of each
phase: frames padded to 4n+1, sizes padded to the VAE's multiple, tile overlaps (the tiled
phase's FLOPs over the untiled one's: overlaps and exact tiling's recomputed halos), frames
shared with the previous batch (``temporal_overlap``). Attention windows carry no padding:
windows of equal length are grouped into one call each (models/attention.py), so that share
is 0 by construction.

    python bench/roofline.py [--model 3b|7b] [--resolution 720|1080|2160] [--batch-size 5]
                             [--setting defaults|tiled|swapped] [--gpu H100] [--json] [--all]
    python bench/roofline.py --check-cpu [--threads N]

``--check-cpu`` runs two mid-size jobs for real on this CPU (float32; ``CHECK_JOBS``: the
released VAE's phases at 64 x 112, the DiT's and colour correction's at 192 x 336), measures
the CPU's matrix-product and convolution rate and its memory bandwidth with a short probe
(``seedvr2.pipeline.work.device_rates``), predicts each phase's time from the counted work the
same way, and prints measured against predicted (best of interleaved repeats; about 3 min).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory_trace as mt  # noqa: E402  (puts src/ on the path)
from seedvr2.models.rope import FrequencyTable  # noqa: E402
from seedvr2.pipeline.runner import Upscaler  # noqa: E402
from seedvr2.pipeline.work import OpCounter, Rates, device_rates  # noqa: E402

PHASES = ("encode", "dit", "decode", "colour")
TRACE_PHASE = {"encode": "encode", "DiT": "dit", "decode": "decode"}  # memory_trace's names


@dataclass(frozen=True)
class Gpu:
    tensor_flops: float  # dense bf16/fp16 tensor FLOP/s with float32 accumulation
    bandwidth: float  # memory bytes/s
    source: str


# Vendor datasheets (dense figures: the datasheets' sparse ones are twice these).
GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): SXM BF16
    # Tensor Core 1,979 TFLOPS with sparsity -> 989 dense, 3.35 TB/s; PCIe (H100 NVL table of
    # the same sheet lists NVL; the PCIe card) 1,513 sparse -> 756 dense, 2.0 TB/s.
    "H100": Gpu(989e12, 3.35e12, "NVIDIA H100 datasheet, SXM: BF16 1979 TFLOPS sparse, 3.35 TB/s"),
    "H100-PCIe": Gpu(756e12, 2.0e12, "NVIDIA H100 datasheet, PCIe: BF16 1513 TFLOPS sparse, 2 TB/s"),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): SXM BF16 1,979 sparse, 4.8 TB/s.
    "H200": Gpu(989e12, 4.8e12, "NVIDIA H200 datasheet, SXM: BF16 1979 TFLOPS sparse, 4.8 TB/s"),
    # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS dense (624 sparse); 80GB SXM 2,039 GB/s.
    "A100": Gpu(312e12, 2.039e12, "NVIDIA A100 datasheet, 80GB SXM: BF16 312 TFLOPS, 2039 GB/s"),
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: FP16/BF16 tensor with FP32 accumulate 71 TFLOPS
    # dense (142 sparse; the FP16-accumulate rate is 142/284), 936 GB/s.
    "RTX-3090": Gpu(71e12, 936e9, "NVIDIA Ampere GA102 whitepaper, RTX 3090: FP16 w/ FP32 "
                    "accumulate 71 TFLOPS, 936 GB/s"),
    # NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: FP16/BF16 tensor with FP32
    # accumulate 165.2 TFLOPS dense (330.3 sparse), 1008 GB/s.
    "RTX-4090": Gpu(165.2e12, 1008e9, "NVIDIA Ada Lovelace whitepaper, RTX 4090: FP16 w/ FP32 "
                    "accumulate 165.2 TFLOPS, 1008 GB/s"),
    # NVIDIA RTX Blackwell GPU architecture whitepaper, RTX 5090: FP16/BF16 tensor with FP32
    # accumulate 209.5 TFLOPS dense (419 sparse), 1792 GB/s.
    "RTX-5090": Gpu(209.5e12, 1792e9, "NVIDIA RTX Blackwell whitepaper, RTX 5090: FP16 w/ FP32 "
                    "accumulate 209.5 TFLOPS, 1792 GB/s"),
}

def _phase_switch(counter: OpCounter):
    """``phase(name, function)`` for ``memory_trace.run_phases``: the counter's phase while
    the function runs; colour correction (``Upscaler._finish``) counted as ``colour``."""
    def phase(name: str, function: Callable):
        counter.phase = TRACE_PHASE[name]
        return function()
    finish = Upscaler._finish

    def colour(self, item, frames):
        counter.phase = "colour"
        return finish(self, item, frames)
    return phase, mock.patch.object(Upscaler, "_finish", colour)


def count_work(models, opts, size, input_size, attention: Callable) -> Counter:
    """The counted ops of one batch of ``opts`` through the pipeline's phase functions."""
    counter = OpCounter()
    phase, colour = _phase_switch(counter)
    with torch.no_grad(), colour, counter, mock.patch.object(
            F, "scaled_dot_product_attention", counter.attention(attention)):
        mt.run_phases(models, opts, size, input_size, phase)
    return counter.ops


_COUNTS: dict = {}


def cell_work(model: str, resolution: int, batch_size: int, tiled: bool,
              device: str = "cuda:0") -> Counter:
    """The counted ops of one real-size cell on fake tensors (``tiled``: the README's tiled
    VAE; ``tiled`` and ``swapped`` differ only in where weights wait), cached."""
    key = (model, resolution, batch_size, tiled)
    if key not in _COUNTS:
        cell = mt.Cell(model, resolution, batch_size, "tiled" if tiled else "defaults")
        with mt.fake_models(model, device) as models, mt.traceable() as _:
            _COUNTS[key] = count_work(models, cell.options(), cell.size, cell.input_size,
                                      mt._fused_attention)
    return _COUNTS[key]


# -- summaries ------------------------------------------------------------------------------

def rates_of(gpu: Gpu) -> Rates:
    return Rates(gpu.tensor_flops, gpu.tensor_flops, gpu.bandwidth)


def phase_totals(ops: Counter, rates: Rates) -> dict:
    """Per phase: flops, bytes, seconds at the limit, and per class flops, bytes, seconds."""
    out = {p: {"flops": 0, "bytes": 0, "seconds": 0.0, "classes": {}} for p in PHASES}
    for (phase, cls, flops, nbytes), n in ops.items():
        if phase not in out:
            continue  # set-up before the first phase (the input frames made for the run)
        row, s = out[phase], rates.seconds(cls, flops, nbytes) * n
        c = row["classes"].setdefault(cls, {"flops": 0, "bytes": 0, "seconds": 0.0})
        for r in (row, c):
            r["flops"] += flops * n
            r["bytes"] += nbytes * n
            r["seconds"] += s
    return out


def waste_shares(cell: mt.Cell, totals: dict, untiled: Optional[dict]) -> dict:
    """Per phase the shares of its FLOPs that are not the user's (see the module text)."""
    opts = cell.options()
    multiple = 16  # pipeline.runner.MODEL_MULTIPLE: the VAE's 8 x the DiT's patch 2
    h, w = cell.size
    hp, wp = -(-h // multiple) * multiple, -(-w // multiple) * multiple
    frames = opts.batch_size
    length = (frames - 1 + 3) // 4 * 4 + 1
    shares = {}
    for phase in PHASES:
        s = {"frames_4n1": 1 - frames / length if phase != "colour" else 0.0,
             "size_multiple": 1 - h * w / (hp * wp) if phase != "colour" else 0.0,
             "tile_overlap": 0.0,
             "batch_overlap": opts.temporal_overlap / frames,
             "attention_padding": 0.0}
        if untiled is not None and phase in ("encode", "decode") and totals[phase]["flops"]:
            s["tile_overlap"] = max(0.0, 1 - untiled[phase]["flops"] / totals[phase]["flops"])
        useful = 1.0
        for v in s.values():
            useful *= 1 - v
        s["total"] = 1 - useful
        shares[phase] = s
    return shares


def cell_rows(cell: mt.Cell, gpu: str) -> list[dict]:
    tiled = cell.setting != "defaults"
    rates = rates_of(GPUS[gpu])
    totals = phase_totals(cell_work(cell.model, cell.resolution, cell.batch_size, tiled), rates)
    untiled = phase_totals(cell_work(cell.model, cell.resolution, cell.batch_size, False),
                           rates) if tiled else None
    shares = waste_shares(cell, totals, untiled)
    base = {"model": cell.model, "resolution": cell.resolution, "batch_size": cell.batch_size,
            "setting": cell.setting, "gpu": gpu}
    return [{**base, "phase": p, "flops": totals[p]["flops"], "bytes": totals[p]["bytes"],
             "limit_s": totals[p]["seconds"], "waste": shares[p],
             "classes": totals[p]["classes"]} for p in PHASES]


def total_row(rows: list[dict], new_frames: int) -> dict:
    flops = sum(r["flops"] for r in rows)
    seconds = sum(r["limit_s"] for r in rows)
    waste = sum(r["flops"] * r["waste"]["total"] for r in rows) / flops
    return {**{k: rows[0][k] for k in ("model", "resolution", "batch_size", "setting", "gpu")},
            "phase": "total", "flops": flops, "flops_per_frame": flops / new_frames,
            "bytes": sum(r["bytes"] for r in rows), "limit_s": seconds,
            "frames_per_s": new_frames / seconds, "waste": waste}


def _prefix(r: dict) -> str:
    return f"roofline {r['model']} {r['resolution']}p b{r['batch_size']} {r['setting']}"


def lines(rows: list[dict], total: dict) -> list[str]:
    out = [f"{_prefix(r)} {r['phase']}: {r['flops'] / 1e12:.1f} TFLOP, {r['bytes'] / 1e9:.0f} GB "
           f"moved, limit {r['limit_s']:.3f} s on {r['gpu']}" for r in rows]
    out.append(f"{_prefix(total)} total: {total['flops_per_frame'] / 1e12:.1f} TFLOP per frame, "
               f"limit {total['frames_per_s']:.2f} frames/s on {total['gpu']}, "
               f"waste {100 * total['waste']:.1f} %")
    return out


LIMIT_HEAD = ("| model | res | batch | setting | encode | DiT | decode | colour | TFLOP/frame | "
              "waste % | " + " | ".join(f"{g} fps" for g in GPUS) + " |\n|"
              + "---|" * (10 + len(GPUS)))


def limit_row(cell: mt.Cell) -> str:
    """Markdown: the cell's TFLOP per phase and frames/s at the limit on each GPU."""
    fps = []
    for gpu in GPUS:
        rows = cell_rows(cell, gpu)
        total = total_row(rows, cell.batch_size - cell.options().temporal_overlap)
        fps.append(f"{total['frames_per_s']:.2f}")
    return (f"| {cell.model} | {cell.resolution}p | {cell.batch_size} | {cell.setting} | "
            + " | ".join(f"{r['flops'] / 1e12:.1f}" for r in rows)
            + f" | {total['flops_per_frame'] / 1e12:.1f} | {100 * total['waste']:.1f} | "
            + " | ".join(fps) + " |")


# -- check on this CPU --------------------------------------------------------------------------

# Two mid-size jobs, each measuring the phases whose work it makes representative:
# (output size, VAE narrowed, the phases it measures). The released VAE at 64 x 112 takes a
# few seconds a phase; the DiT there would see 56 video tokens, products so skinny that a CPU
# runs them at half its matrix rate on 2 threads, far from any real job's thousands of tokens,
# so the DiT (and colour correction, a few ms at 64 x 112: per-call costs) is measured in a
# job of 504 tokens, 192 x 336, whose VAE is narrowed to a quarter of its widths to stay cheap.
CHECK_JOBS = (((64, 112), False, ("encode", "decode")), ((192, 336), True, ("dit", "colour")))


def check_models(narrow_vae: bool):
    """A mid-size DiT (the 3B's width, 2 blocks) and the released VAE's architecture (its
    widths quartered if ``narrow_vae``), random weights, float32 on the CPU."""
    from seedvr2.models.config import dit_config, vae_config

    full = dit_config("3b")
    dit_cfg = replace(full, num_layers=2, block_type=full.block_type[:2],
                      window=full.window[:2], window_method=full.window_method[:2], mm_layers=1)
    vae_cfg = vae_config("vae")
    if narrow_vae:
        vae_cfg = replace(vae_cfg, block_out_channels=tuple(c // 4 for c in
                                                            vae_cfg.block_out_channels))
    models = mt.build_models(dit_cfg, vae_cfg, "cpu", torch.float32)
    with torch.no_grad():
        for t in list(models.dit.parameters()) + list(models.vae.parameters()):
            t.normal_(0, 0.02)
        for table in models.dit.modules():  # built empty: uninitialised memory, NaN at times
            if isinstance(table, FrequencyTable):
                table.freqs.copy_(table.defining_values())
    return models


def timed_phases(models, opts, size, input_size) -> dict:
    """Seconds per phase of one real run through the pipeline's phase functions (colour
    correction, inside the decode, counted apart from it)."""
    times = {}

    def phase(name, function):
        start = time.perf_counter()
        out = function()
        times[TRACE_PHASE[name]] = time.perf_counter() - start - times.get("colour", 0)
        return out
    finish = Upscaler._finish

    def colour(self, item, frames):
        start = time.perf_counter()
        out = finish(self, item, frames)
        times["colour"] = time.perf_counter() - start
        return out
    with torch.no_grad(), mock.patch.object(Upscaler, "_finish", colour):
        mt.run_phases(models, opts, size, input_size, phase)
    return times


def check_cpu(threads: int, repeats: int = 3) -> list[dict]:
    """Measured (best of ``repeats`` interleaved runs) against predicted time per phase."""
    torch.set_num_threads(threads)
    jobs = []
    for size, narrow, phases in CHECK_JOBS:
        models, input_size = check_models(narrow), (size[0] // 2, size[1] // 2)
        opts = mt.resolve_options(device="cpu", dtype="fp32", batch_size=5, resolution=size[0],
                                  color_correction="wavelet")
        ops = count_work(models, opts, size, input_size, F.scaled_dot_product_attention)
        jobs.append((models, opts, size, input_size, phases, ops))
    measured, rates = {}, []
    for _ in range(repeats):
        device_rates.cache_clear()
        rates.append(device_rates("cpu", torch.float32)[0])
        for models, opts, size, input_size, phases, _ in jobs:
            times = timed_phases(models, opts, size, input_size)
            for p in phases:
                measured[p] = min(measured.get(p, float("inf")), times[p])
    best = Rates(max(r.matmul for r in rates), max(r.conv for r in rates),
                 max(r.bandwidth for r in rates))
    predicted = {p: phase_totals(ops, best)[p]["seconds"]
                 for *_, phases, ops in jobs for p in phases}
    return [{"threads": threads, "phase": p, "measured_s": measured[p],
             "predicted_s": predicted[p], "ratio": measured[p] / predicted[p]} for p in PHASES]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("3b", "7b"), default="3b")
    parser.add_argument("--resolution", type=int, choices=sorted(mt.RESOLUTIONS), default=1080)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--setting", choices=mt.SETTINGS, default="defaults")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="H100")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--all", action="store_true",
                        help="the README's cells: the limit table on every GPU (markdown)")
    parser.add_argument("--check-cpu", action="store_true",
                        help="predicted against measured time of a mid-size job on this CPU")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.check_cpu:
        rows = []
        for threads in ([args.threads] if args.threads else [1, 2]):
            rows += check_cpu(threads)
            for r in rows[-len(PHASES):]:
                print(f"roofline check-cpu {r['phase']}: measured {r['measured_s']:.3f} s, "
                      f"predicted {r['predicted_s']:.3f} s, ratio {r['ratio']:.2f} "
                      f"({r['threads']} threads)", flush=True)
        if args.json:
            print(json.dumps(rows, indent=1))
        return 0 if all(0.67 <= r["ratio"] <= 1.5 for r in rows) else 1
    if args.batch_size < 1 or args.batch_size % 4 != 1:
        parser.error("--batch-size must be 4n+1 (1, 5, 9, ...)")
    if args.all:
        print(LIMIT_HEAD, flush=True)
        for cell in mt.readme_cells():
            print(limit_row(cell), flush=True)
        return 0
    cell = mt.Cell(args.model, args.resolution, args.batch_size, args.setting)
    rows = cell_rows(cell, args.gpu)
    total = total_row(rows, cell.batch_size - cell.options().temporal_overlap)
    if args.json:
        print(json.dumps(rows + [total], indent=1))
    else:
        print("\n".join(lines(rows, total)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
