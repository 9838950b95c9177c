"""VAE encode + decode throughput against the machine's own matmul throughput.

Real VAE configuration (``configs/vae.json``, random weights), one 5-frame 128x128 clip,
fp32 on CPU by default. FLOPs come from ``torch.utils.flop_counter`` (convolutions and
matmuls; the mid-block attention at 1/8 resolution is not counted, which only lowers the
ratio). Prints both rates and their ratio.

    python bench/vae_roundtrip.py [--device cpu] [--dtype fp32] [--frames 5] [--size 128]
                                  [--channels-last]    (channels-last padded buffers and convs)
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.flop_counter import FlopCounterMode

from common import DTYPES, best_time, matmul_flops_per_s, synchronizer
from seedvr2.models import build_vae
from seedvr2.models.vae_paths import VaePaths


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--channels-last", action="store_true",
                        help="the VAE's channels_last path (option vae_channels_last)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    sync = synchronizer(device)
    torch.manual_seed(0)
    matmul_flops = matmul_flops_per_s(device, dtype)

    with torch.device(device):
        vae = build_vae("vae").to(dtype).eval()
    for p in vae.parameters():
        torch.nn.init.normal_(p, std=0.02)
    vae.set_conv_settings(cudnn_benchmark=False, paths=VaePaths(channels_last=args.channels_last))
    video = torch.rand(1, 3, args.frames, args.size, args.size, device=device, dtype=dtype) * 2 - 1

    def roundtrip():
        return vae.decode(vae.encode(video))

    with torch.inference_mode():
        with FlopCounterMode(display=False) as counter:
            roundtrip()
        flops = counter.get_total_flops()
        seconds = best_time(roundtrip, args.repeats, sync)
    print(f"device {device}, dtype {args.dtype}, threads {torch.get_num_threads()}, "
          f"clip {args.frames}x{args.size}x{args.size}, channels_last {args.channels_last}")
    print(f"matmul 2048^2: {matmul_flops / 1e9:.1f} GFLOP/s")
    print(f"VAE encode+decode: {seconds * 1e3:.0f} ms, {flops / 1e9:.1f} GFLOP, "
          f"{flops / seconds / 1e9:.1f} GFLOP/s")
    print(f"ratio VAE/matmul: {flops / seconds / matmul_flops:.3f}")


if __name__ == "__main__":
    main()
