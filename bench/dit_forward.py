"""DiT forward throughput against the machine's own matmul throughput (fp32, CPU by default).

Configuration (fixed by the foundation issue): 3B family, vid_dim 1024, 8 heads x 128,
4 layers (mm_layers 2), txt_in_dim 5120, one sample with latent 2x64x64 and 58 text tokens.
FLOPs are counted analytically from the actual attention windows (multiply-add = 2 FLOPs).
Prints achieved FLOP/s, matmul FLOP/s on 2048x2048 and their ratio (goal >= 0.75).

    python bench/dit_forward.py [--device cpu] [--dtype fp32] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch
from common import DTYPES, best_time, matmul_flops_per_s, synchronizer

from seedvr2.models import build_dit, dit_config
from seedvr2.models.window import WindowLayout

def config():
    cfg = dit_config("3b").to_dict()
    cfg.update(vid_dim=1024, txt_dim=1024, emb_dim=6 * 1024, heads=8, head_dim=128, num_layers=4,
               mm_layers=2, block_type=["mmdit_sr"] * 4, window=[[4, 3, 3]] * 4,
               window_method=["720pwin_by_size_bysize", "720pswin_by_size_bysize"] * 2)
    return cfg


def count_flops(model, thw, txt_len) -> float:
    cfg = model.config
    d, hidden = cfg.vid_dim, cfg.mlp_hidden_dim
    t, h, w = thw
    nv, nt = t * (h // 2) * (w // 2), txt_len
    flops = 2 * nv * (4 * cfg.vid_in_channels) * d + 2 * nt * cfg.txt_in_dim * d
    flops += 2 * nv * d * 4 * cfg.vid_out_channels
    mlp_mats = 3 if cfg.mlp_type == "swiglu" else 2
    for block in model.blocks:
        layout = WindowLayout.build(block.window_method, block.window, [(t, h // 2, w // 2)],
                                    [txt_len], torch.device("cpu"))
        text_rows = 0 if block.video_only else nt
        rows = nv + text_rows
        flops += 2 * (nv + nt) * d * 3 * d + 2 * rows * d * d  # qkv, out projection
        flops += 2 * rows * d * hidden * mlp_mats
        for g in layout.groups:
            seq = g.vid_len + nt
            queries = g.vid_len + text_rows
            flops += g.count * 4 * queries * seq * d  # QK^T and AV
    return float(flops)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    sync = synchronizer(device)
    torch.manual_seed(0)
    matmul_flops = matmul_flops_per_s(device, dtype)

    with torch.device(device):
        model = build_dit(config()).to(dtype).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    thw, txt_len = (2, 64, 64), 58
    vid = torch.randn(thw[0] * thw[1] * thw[2], 33, device=device, dtype=dtype)
    txt = torch.randn(txt_len, 5120, device=device, dtype=dtype)
    # Shapes stay on the CPU, as the pipeline passes them (the DiT reads them on the host).
    vid_shape, txt_shape = torch.tensor([thw]), torch.tensor([[txt_len]])
    timestep = torch.full((1,), 1000.0, device=device)

    with torch.inference_mode():
        forward_s = best_time(lambda: model(vid, txt, vid_shape, txt_shape, timestep), args.repeats, sync)
    flops = count_flops(model, thw, txt_len)
    print(f"device {device}, dtype {args.dtype}, threads {torch.get_num_threads()}")
    print(f"matmul 2048^2: {matmul_flops / 1e9:.1f} GFLOP/s")
    print(f"DiT forward: {forward_s * 1e3:.1f} ms, {flops / 1e9:.1f} GFLOP, {flops / forward_s / 1e9:.1f} GFLOP/s")
    print(f"ratio DiT/matmul: {flops / forward_s / matmul_flops:.3f}  (goal >= 0.75)")


if __name__ == "__main__":
    main()
