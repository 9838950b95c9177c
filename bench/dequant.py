"""GGUF dequantisation throughput, as GB/s of output, beside the memory-bandwidth limit.

For Q8_0, Q4_K and Q6_K by default (``--types`` also takes Q2_K, Q3_K, Q5_K), a 4096 x 4096
weight: our torch dequantisation into a preallocated output, a plain copy of a float tensor of
the same output size into a preallocated output (the memory-bandwidth limit; the ratio is what
the goals are about: Q8_0 >= 0.5 of copy, K-quants >= 0.25), and, on the CPU,
``gguf.quants.dequantize`` (numpy) on the same bytes. Q8_0 blocks come from quantising random
weights; the K-quants, which the gguf package cannot write, are random blocks with finite
scales.

    .venv/bin/python bench/dequant.py                 # CPU, fp32 output, torch's threads
    .venv/bin/python bench/dequant.py --threads 1 --types Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K
    .venv/bin/python bench/dequant.py --device cuda --dtype bf16

With several torch threads our CPU dequantisation shares its chunks out to as many Python
threads (see ``seedvr2.loading.gguf``); ``--threads 1`` measures one core.

The ratios are measured in one process, interleaved (best of --repeats), so they compare
implementations rather than machines.

``--load-rss`` instead measures loading: it writes a 3B-width (vid_dim 2560), 8-layer fp16
DiT (~1.7 GB) and reports the anonymous RSS growth of ``load_dit`` on the CPU against the
file size (goal <= 1.2x).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import DTYPES, synchronizer  # noqa: E402

from seedvr2.loading.gguf import BLOCK_SIZES, dequantize_blocks  # noqa: E402

# byte offsets of the fp16 scales, set to finite values in random blocks
FP16_FIELDS = {"Q8_0": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [208]}


def make_blocks(qtype: str, values: int, seed: int = 0) -> np.ndarray:
    import gguf

    rng = np.random.default_rng(seed)
    if qtype == "Q8_0":
        weights = rng.standard_normal((values // 4096, 4096)).astype(np.float32) * 0.02
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0).reshape(
            -1, BLOCK_SIZES[qtype][1])
    block, type_size = BLOCK_SIZES[qtype]
    blocks = rng.integers(0, 256, (values // block, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = (rng.standard_normal((len(blocks), 1)) * 0.05) \
            .astype(np.float16).view(np.uint8)
    return blocks


def interleaved_best(fns: dict, repeats: int, sync) -> dict:
    """Best wall time of each function, the functions run in turn (same machine state)."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    sync()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def throughput(args):
    import gguf

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    sync = synchronizer(device)
    values = args.rows * args.cols
    out = torch.empty(values, dtype=dtype, device=device)
    source = torch.randn(values, device=device).to(dtype)
    out_bytes = values * out.element_size()
    print(f"device {device}, output {args.rows}x{args.cols} {args.dtype} "
          f"({out_bytes / 2**20:.0f} MiB), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for qtype in args.types:
        blocks_np = make_blocks(qtype, values)
        blocks = torch.from_numpy(blocks_np).to(device)
        fns = {"copy": lambda: out.copy_(source),
               "ours": lambda: dequantize_blocks(blocks, qtype, dtype, out=out)}
        if device.type == "cpu" and not args.no_numpy:
            ggml = getattr(gguf.GGMLQuantizationType, qtype)
            fns["gguf.quants"] = lambda: gguf.quants.dequantize(blocks_np, ggml)
        best = interleaved_best(fns, args.repeats, sync)
        rate = {name: out_bytes / t / 1e9 for name, t in best.items()}
        line = (f"{qtype}: ours {rate['ours']:.2f} GB/s, copy {rate['copy']:.2f} GB/s, "
                f"ratio {rate['ours'] / rate['copy']:.2f} (goal >= "
                f"{0.5 if qtype == 'Q8_0' else 0.25})")
        if "gguf.quants" in rate:  # numpy always produces fp32: rate of its own output
            numpy_rate = values * 4 / best["gguf.quants"] / 1e9
            line += f"; gguf.quants {numpy_rate:.2f} GB/s (fp32), ours/gguf {best['gguf.quants'] / best['ours']:.1f}x"
        print(line)


def anonymous_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def load_rss(args):
    import gc
    import json

    from safetensors.torch import save_file

    from seedvr2.loading import load_dit
    from seedvr2.models import build_dit
    from seedvr2.models.config import dit_config

    full = dit_config("3b").to_dict()
    config = dict(full, num_layers=8, mm_layers=4, block_type=["mmdit_sr"] * 8,
                  window=full["window"][:8], window_method=full["window_method"][:8])
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="seedvr2-bench-"))
    path = folder / "dit3b_width_8layers_fp16.safetensors"
    if not path.exists():
        with torch.device("meta"):
            shapes = {k: (v.shape, v.dtype) for k, v in build_dit(dit_config(config)).state_dict().items()}
        state = {k: (torch.randn(s) * 0.02).half() for k, (s, _) in shapes.items()}
        save_file(state, path, metadata={"config": json.dumps(config)})
        del state
        gc.collect()
    size = path.stat().st_size
    # dtype None keeps fp16: the weights stay views of the file's memory map (file-backed
    # pages, not anonymous memory); bf16 converts every tensor, so the model is materialised.
    for dtype in (None, torch.bfloat16):
        gc.collect()
        before = anonymous_rss()
        start = time.perf_counter()
        model = load_dit(path, dtype=dtype)
        seconds = time.perf_counter() - start
        growth = anonymous_rss() - before
        params = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        print(f"{path.name} -> {str(dtype or 'file dtype').replace('torch.', '')}: file "
              f"{size / 2**30:.2f} GiB, {params / 2**30:.2f} GiB of tensors loaded in "
              f"{seconds:.1f}s; anonymous RSS growth {growth / 2**30:.2f} GiB = "
              f"{growth / size:.2f}x the file (goal <= 1.2x)")
        del model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K", "Q6_K"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-numpy", action="store_true", help="skip gguf.quants (slow)")
    parser.add_argument("--load-rss", action="store_true", help="measure load memory instead")
    parser.add_argument("--workdir", help="folder for the generated --load-rss file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_rss(args) if args.load_rss else throughput(args)


if __name__ == "__main__":
    main()
