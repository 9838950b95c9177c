"""BlockSwap cost on a GPU: the 3B-shaped DiT (random weights), 21 frames at 720p, bf16.

Times one DiT forward and records peak VRAM with 0, 16 and 32 blocks swapped to pinned host
memory (prefetched one block ahead on a side stream). Goal: 32 swapped <= 1.15x the time of
0 swapped. Needs CUDA; on a machine without it, prints why and exits 0.

    python bench/blockswap.py [--blocks 0,16,32] [--frames 21] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import best_time, synchronizer

from seedvr2.memory.blockswap import BlockSwap
from seedvr2.models import build_dit, dit_config


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="0,16,32")
    parser.add_argument("--frames", type=int, default=21)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/blockswap.py needs a CUDA device; nothing measured")
        return 0
    device, dtype = torch.device("cuda"), torch.bfloat16
    sync = synchronizer(device)
    torch.manual_seed(0)
    thw = ((args.frames - 1) // 4 + 1, args.height // 8, args.width // 8)  # latent frames, h, w
    txt_len = 58
    vid = torch.randn(thw[0] * thw[1] * thw[2], 33, device=device, dtype=dtype)
    txt = torch.randn(txt_len, 5120, device=device, dtype=dtype)
    # Shapes stay on the CPU, as the pipeline passes them (the DiT reads them on the host).
    vid_shape, txt_shape = torch.tensor([thw]), torch.tensor([[txt_len]])
    timestep = torch.full((1,), 1000.0, device=device)

    model = build_dit(dit_config("3b")).eval().to(dtype)  # on the host: ~14 GB while building
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    print(f"3B-shaped DiT, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"latent {thw} ({args.frames} frames {args.width}x{args.height}), bf16, "
          f"{torch.cuda.get_device_name(device)}")
    times = {}
    for blocks in (int(b) for b in args.blocks.split(",")):
        swap = BlockSwap(model, blocks, False, device, torch.device("cpu")) if blocks else None
        if swap is None:
            model.to(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            seconds = best_time(lambda: model(vid, txt, vid_shape, txt_shape, timestep), args.repeats, sync)
        peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
        times[blocks] = seconds
        ratio = seconds / times[min(times)]
        print(f"blocks_to_swap {blocks:3d}: {seconds * 1e3:8.1f} ms, peak {peak:6.2f} GiB, "
              f"time ratio vs {min(times)} swapped {ratio:.3f}")
        if swap is not None:
            swap.leave()
        model.to("cpu")
    if 0 in times and 32 in times:
        print(f"32 swapped / 0 swapped: {times[32] / times[0]:.3f}  (goal <= 1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
