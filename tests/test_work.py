"""seedvr2.pipeline.work: a job's work counted before it runs, and its time from a probe.

The counted work agrees with bench/roofline.py's count of the same phases (the independent
count there is torch's FlopCounterMode, tests/test_roofline.py); the time estimate of a
mid-size CPU job (the released VAE's architecture at its widths, random weights, 48 x 64; a
few seconds: a narrowed VAE's layers run far below the probe's rate, unlike a real job's)
brackets the measured time within a factor 1.5 beyond the probe's own spread (its best and
worst rounds give the estimate's range)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from seedvr2.loading import load_dit
from seedvr2.models import build_vae, window
from seedvr2.models.config import vae_config
from seedvr2.options import resolve_options
from seedvr2.pipeline.plan import make_plan
from seedvr2.pipeline.runner import Models
from seedvr2.pipeline.work import device_rates, job_work

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import memory_trace  # noqa: E402
import roofline  # noqa: E402

SIZE, INPUT = (48, 64), (24, 32)


@pytest.fixture(scope="module")
def mid_models(tiny_model_dir):
    torch.manual_seed(0)
    vae = build_vae(vae_config("vae")).eval()
    dit = load_dit(str(tiny_model_dir / "dit3b_tiny.safetensors"), torch.float32, "cpu")
    text = torch.zeros(memory_trace.mem.TEXT_TOKENS, dit.config.txt_in_dim)
    return Models(dit, vae.requires_grad_(False), text, torch.device("cpu"),
                  torch.device("cpu"), torch.float32)


def _opts():
    return resolve_options(device="cpu", dtype="fp32", batch_size=5, resolution=SIZE[0],
                           color_correction="none", scene_cuts="off")


def test_counted_work_agrees_with_the_phase_count(mid_models):
    """The estimate's VAE (a small run on meta, scaled) and DiT (its products and windows)
    against the dispatch count of the real phases: within 10 % per phase."""
    window._layouts.clear()
    ops = roofline.count_work(mid_models, _opts(), SIZE, INPUT,
                              torch.nn.functional.scaled_dot_product_attention)
    counted = {p: r["flops"] for p, r in roofline.phase_totals(
        ops, roofline.rates_of(roofline.GPUS["H100"])).items()}
    work = job_work(mid_models.dit, mid_models.vae.config, make_plan(5, _opts()), _opts(), SIZE,
                    torch.float32)
    estimated = {}
    for (phase, _, flops, _), n in work.ops.items():
        estimated[phase] = estimated.get(phase, 0) + flops * n
    for phase in ("encode", "dit", "decode"):
        assert estimated[phase] == pytest.approx(counted[phase], rel=0.10), phase


def test_time_estimate_brackets_a_cpu_job(mid_models):
    opts = _opts()
    work = job_work(mid_models.dit, mid_models.vae.config, make_plan(5, opts), opts, SIZE,
                    torch.float32)
    lo, hi = work.seconds("cpu", torch.float32)
    best, worst = device_rates("cpu", torch.float32)
    assert lo <= hi and best.matmul >= worst.matmul
    measured = float("inf")
    for _ in range(2):  # best of two: a shared machine only ever slows a run down
        window._layouts.clear()
        start = time.perf_counter()
        with torch.no_grad():
            memory_trace.run_phases(mid_models, opts, SIZE, INPUT, lambda name, f: f())
        measured = min(measured, time.perf_counter() - start)
    assert lo / 1.5 <= measured <= hi * 1.5, (lo, measured, hi)


def test_tiled_vae_work_at_1080p_is_at_most_135_percent_of_untiled():
    """Issue 43's bound: 512-px tiles with a 64-px overlap on 3B 1080p, batch 5 (the README's
    tiled setting) cost at most 1.35x the untiled VAE work (edge tiles overhanging their
    neighbours cost 1.84x)."""
    from seedvr2.models import build_on_meta
    from seedvr2.models.config import dit_config

    dit = build_on_meta("dit", dit_config("3b"))
    vae_flops = []
    for tiled in (False, True):
        opts = resolve_options(batch_size=5, resolution=1080, scene_cuts="off",
                               vae_encode_tiled=tiled, vae_decode_tiled=tiled)
        work = job_work(dit, vae_config("vae"), make_plan(5, opts), opts, (1080, 1920),
                        torch.bfloat16)
        vae_flops.append(sum(f * n for (phase, _, f, _), n in work.ops.items() if phase != "dit"))
    assert 1.2 < vae_flops[1] / vae_flops[0] <= 1.35
