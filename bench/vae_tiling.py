"""Peak memory and error of VAE decode and encode with spatial tiling off and on.

Real VAE configuration (``configs/vae.json``, random weights, normal std 0.02, seed 0), one
clip (default: 1 frame, 256x256, fp32 on the CPU). Each setting runs in a fresh process so
that its peak is its own: on the CPU the peak resident set size (``ru_maxrss`` from
``os.wait4``; torch's CPU allocations are invisible to ``tracemalloc``), on CUDA
``torch.cuda.max_memory_allocated`` (device memory only: exact mode's planes on the default
``state_device="cpu"`` are host memory and not in that figure). Only the half of the VAE that
runs is materialised (the other half stays on the meta device), so the fixed part of the peak
is small.

Settings: untiled, then each ``--tiles`` tile/overlap pair in each ``--modes`` mode
(``exact``: frame-wide planes, tile-wise layers; ``fast``: independent cross-faded tiles; see
``seedvr2.memory.tiling``). Printed per setting: peak, the part above the process's level
just before the call (model, input and runtime: the VAE's working memory), wall time, both
ratios to the untiled run, and the error against the untiled output: max abs difference
relative to the untiled output's max abs value, and the mean abs difference.

    python bench/vae_tiling.py [--frames 1] [--size 256] [--tiles 128/32 64/16]
                               [--modes exact fast] [--stages decode encode]
                               [--temporal-chunk N] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    """Run one stage with one setting, save the output, print a JSON line with its figures."""
    import torch

    from seedvr2.memory.tiling import TileSettings, decode, encode
    from seedvr2.models import build_vae

    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device("meta"):
        vae = build_vae("vae").eval()
    half = vae.decoder if args.stage == "decode" else vae.encoder
    half.to_empty(device=device)
    for p in half.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tile, overlap = args.setting
    tiles = TileSettings(enabled=tile > 0, tile_size=tile or 512, tile_overlap=overlap,
                         exact=args.mode == "exact")
    s, f = vae.spatial_factor, vae.temporal_factor
    g = torch.Generator().manual_seed(1)
    if args.stage == "decode":
        x = torch.randn(1, vae.latent_channels, (args.frames - 1) // f + 1, args.size // s,
                        args.size // s, generator=g).to(device)
    else:
        x = (torch.rand(1, 3, args.frames, args.size, args.size, generator=g) * 2 - 1).to(device)
    run = decode if args.stage == "decode" else encode

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with torch.inference_mode():
        out = run(vae, x, tiles, args.temporal_chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = time.perf_counter() - start
    torch.save(out.float().cpu(), args.output)
    print(json.dumps(dict(before=before, peak=peak, seconds=seconds, shape=list(out.shape),
                          finite=bool(torch.isfinite(out).all()))))


def measure(args, stage: str, setting, mode: str, output: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", stage, "--setting", f"{setting[0]}/{setting[1]}",
           "--mode", mode, "--frames", str(args.frames), "--size", str(args.size),
           "--device", args.device, "--output", str(output)]
    if args.temporal_chunk:
        cmd += ["--temporal-chunk", str(args.temporal_chunk)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    output_text = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{stage} {setting} {mode} failed with status {status}")
    result = json.loads(output_text.strip().splitlines()[-1])
    if args.device == "cpu":  # the whole process's high-water mark (Linux: KiB)
        result["peak"] = max(result["peak"], usage.ru_maxrss * 1024)
    return result


def parse_setting(text: str):
    tile, _, overlap = text.partition("/")
    return int(tile), int(overlap or 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=1, help="video frames, 4n+1")
    parser.add_argument("--size", type=int, default=256, help="frame height = width, pixels")
    parser.add_argument("--tiles", type=parse_setting, nargs="+",
                        default=[(128, 32), (64, 16)], help="tile/overlap pairs in pixels")
    parser.add_argument("--modes", nargs="+", default=["exact", "fast"],
                        choices=["exact", "fast"])
    parser.add_argument("--stages", nargs="+", default=["decode", "encode"],
                        choices=["decode", "encode"])
    parser.add_argument("--temporal-chunk", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", choices=["decode", "encode"], help=argparse.SUPPRESS)
    parser.add_argument("--setting", type=parse_setting, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="exact", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.stage = args.worker
        return worker(args)

    import torch

    unit = "peak CUDA allocated" if args.device.startswith("cuda") else "peak RSS"
    print(f"real VAE config, random weights, {args.frames} frame(s) {args.size}x{args.size}, "
          f"fp32 on {args.device}, temporal chunk {args.temporal_chunk}; {unit} per fresh process")
    with tempfile.TemporaryDirectory() as folder:
        for stage in args.stages:
            base = reference = None
            runs = [((0, 0), "exact")] + [(t, m) for t in args.tiles for m in args.modes]
            for setting, mode in runs:
                path = Path(folder) / f"{stage}_{setting[0]}_{mode}.pt"
                r = measure(args, stage, setting, mode, path)
                out = torch.load(path)
                peak, work = r["peak"] / 2 ** 20, (r["peak"] - r["before"]) / 2 ** 20
                if base is None:
                    base, reference = (peak, work), out
                    name, error = "untiled", ""
                else:
                    name = f"{mode} {setting[0]}/{setting[1]}"
                    diff = (out - reference).abs()
                    error = (f"  error max {diff.max().item() / reference.abs().max().item():.1e}"
                             f" of range, mean abs {diff.mean().item():.1e}")
                flag = "" if r["finite"] else "  NON-FINITE OUTPUT"
                print(f"{stage:6s} {name:16s} peak {peak:6.0f} MiB  working {work:6.0f} MiB  "
                      f"{r['seconds']:6.1f} s  ratio to untiled: peak {peak / base[0]:.3f}, "
                      f"working {work / max(base[1], 1e-9):.3f}{error}{flag}", flush=True)


if __name__ == "__main__":
    main()
