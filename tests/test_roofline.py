"""bench/roofline.py: the work it counts per phase agrees with torch's own FlopCounterMode
around the same phase functions (tiny models, real CPU tensors, attention as plain matrix
products so the independent count sees its FLOPs), and its lines read as the issue gives
them. The real-size cells and the CPU check are bench/RESULTS.md's (they take minutes)."""

from __future__ import annotations

import re
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from seedvr2.loading import load_dit, load_vae
from seedvr2.models import window
from seedvr2.options import resolve_options
from seedvr2.pipeline.runner import Models

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import memory_trace  # noqa: E402
import roofline  # noqa: E402

SIZE, INPUT = (64, 96), (32, 48)  # small: the counting does not depend on the size


def _math_attention(q, k, v, *args, **kwargs):
    """Softmax attention as two batched matrix products, which FlopCounterMode counts."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("tiled", [False, True])
def test_counts_agree_with_torchs_flop_counter(tiny_options, tiled):
    dit = load_dit(tiny_options["dit"], torch.float32, "cpu")
    vae = load_vae(tiny_options["vae"], torch.float32, "cpu")
    models = Models(dit, vae, torch.zeros(memory_trace.mem.TEXT_TOKENS, dit.config.txt_in_dim),
                    torch.device("cpu"), torch.device("cpu"), torch.float32)
    opts = resolve_options(device="cpu", dtype="fp32", batch_size=5, resolution=SIZE[0],
                           color_correction="wavelet", vae_encode_tiled=tiled,
                           vae_decode_tiled=tiled, vae_encode_tile_size=64,
                           vae_decode_tile_size=64, vae_encode_tile_overlap=16,
                           vae_decode_tile_overlap=16)
    window._layouts.clear()
    ops = roofline.count_work(models, opts, SIZE, INPUT, _math_attention)
    ours = roofline.phase_totals(ops, roofline.rates_of(roofline.GPUS["H100"]))
    theirs = {}

    def phase(name, function):
        with FlopCounterMode(display=False) as counter:
            out = function()
        theirs[roofline.TRACE_PHASE[name]] = counter.get_total_flops()
        return out

    with torch.no_grad(), mock.patch.object(F, "scaled_dot_product_attention", _math_attention):
        memory_trace.run_phases(models, opts, SIZE, INPUT, phase)
    # decode's count includes colour correction's (run inside it).
    ours["decode"]["flops"] += ours.pop("colour")["flops"]
    for p, flops in theirs.items():
        assert flops > 0
        assert ours[p]["flops"] == pytest.approx(flops, rel=0.10), (p, ours[p]["flops"], flops)
    assert ours["encode"]["bytes"] > 0 and ours["dit"]["bytes"] > 0


def test_lines_read_as_the_issue_gives_them():
    rows = [{"model": "3b", "resolution": 1080, "batch_size": 5, "setting": "defaults",
             "gpu": "H100", "phase": p, "flops": f * 1e12, "bytes": 2e9, "limit_s": 0.5,
             "waste": {"total": 0.1}} for p, f in zip(roofline.PHASES, (104, 86, 261, 0.01))]
    total = roofline.total_row(rows, 5)
    out = roofline.lines(rows, total)
    assert out[0] == "roofline 3b 1080p b5 defaults encode: 104.0 TFLOP, 2 GB moved, " \
                     "limit 0.500 s on H100"
    assert [re.match(r"roofline 3b 1080p b5 defaults (\w+):", line)[1] for line in out] == \
        ["encode", "dit", "decode", "colour", "total"]
    assert out[-1] == "roofline 3b 1080p b5 defaults total: 90.2 TFLOP per frame, " \
                      "limit 2.50 frames/s on H100, waste 10.0 %"
