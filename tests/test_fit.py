"""Jobs that fit themselves (``fit`` auto, ``max_vram``): a tiny-model job capped below what
its settings need runs with the cheapest change that fits and says so in one line; with
``fit`` strict it is refused naming that change; a fitted file job, killed and run again,
resumes. ``max_vram`` caps whatever the compute device is, so all of this runs on the CPU."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from seedvr2.memory import budget as mem
from seedvr2.memory.budget import GIB, Budget, Placement, Weights
from seedvr2.models.config import dit_config, vae_config
from seedvr2.options import OptionError, resolve_options

from conftest import REPO, make_clip
from hostile import outcome

# 23 frames in batches of 5 overlapping by 1 (test_resume.py's plan): six batches, three
# segments of two batches each with segments of at least 8 frames.
SEGMENT_ENV = {"SEEDVR2_SEGMENT_FRAMES": "8"}
SIZE = (32, 42)  # the output of the 64x48 clip at resolution 32 (H, W)


def _need(tiny_options, batch: int) -> int:
    """The budget's peak on the CPU for the test's job at ``batch`` frames per batch, from the
    weight files' headers (as a job computes it)."""
    from seedvr2.pipeline.setup import _budget_job

    dit, dit_cfg = Weights.from_file(tiny_options["dit"], "dit", torch.float32)
    vae, vae_cfg = Weights.from_file(tiny_options["vae"], "vae", torch.float32)
    opts = resolve_options(device="cpu", dtype="fp32", resolution=32, batch_size=batch,
                           temporal_overlap=min(1, batch - 1))
    job = _budget_job(opts, SIZE, batch, torch.float32, mem.TEXT_TOKENS, {"cpu"})
    budget = Budget(dit_cfg, vae_cfg, dit, vae)
    return mem.estimate(budget, job, Placement("cpu", "cpu")).peak("cpu")


@pytest.fixture(scope="module")
def cap(tiny_options) -> str:
    """A max_vram (GiB) between what batches of 5 and of 9 need: batch 9 does not fit it."""
    five, nine = _need(tiny_options, 5), _need(tiny_options, 9)
    assert five < nine
    return f"{(five + nine) / 2 / GIB:.6f}"


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "clip.mp4"
    make_clip(path, frames=23)
    return path


def _cli(tiny_options, src, dst, *extra, env=None):
    cmd = [sys.executable, "-m", "seedvr2", "upscale", str(src), "-o", str(dst),
           "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
           "--model-dir", str(tiny_options["model_dir"]), "--dtype", "fp32", "--device", "cpu",
           "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
           "--resolution", "32", "--temporal-overlap", "1", *extra]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **SEGMENT_ENV, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=environment,
                          timeout=300)


def _frames(path):
    from seedvr2.io import open_media

    with open_media(path) as media:
        return np.stack(list(media.frames()))


def test_capped_job_fits_itself_and_resumes(clip, tiny_options, tmp_path, cap):
    """Batch 9 over a cap that fits 5: fit auto runs batch 5 (the frames of a batch-5 job) and
    says so; killed and run again it resumes (fit and max_vram are not in the job's identity,
    the batch size it chose is); fit strict refuses, naming the batch size."""
    plain = _cli(tiny_options, clip, tmp_path / "plain.mp4", "--batch-size", "5")
    assert plain.returncode == 0, plain.stderr[-2000:]
    out = tmp_path / "up.mp4"
    fitted = ("--batch-size", "9", "--max-vram", cap)
    killed = _cli(tiny_options, clip, out, *fitted, env={"SEEDVR2_KILL_AT": "journal:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    line = re.search(r"^.*--fit auto: .*$", killed.stderr, re.MULTILINE)
    assert line, killed.stderr[-2000:]
    assert re.search(rf"the \w+ phase needs about [\d.]+ MiB on cpu but [\d.]+ MiB is available "
                     rf"\(--max-vram {cap}\); running with --batch-size 5 \(costs: smaller "
                     rf"batches: less temporal consistency\)\. --fit strict stops instead$",
                     line.group(0)), line.group(0)
    again = _cli(tiny_options, clip, out, *fitted)
    assert again.returncode == 0, again.stderr[-2000:]
    reused = re.search(r"(\d+) of 6 batches reused", again.stdout + again.stderr)
    assert reused and int(reused.group(1)) == 4, again.stdout[-2000:] + again.stderr[-2000:]
    assert np.array_equal(_frames(out), _frames(tmp_path / "plain.mp4"))
    strict = _cli(tiny_options, clip, tmp_path / "strict.mp4", *fitted, "--fit", "strict")
    assert strict.returncode != 0
    assert "not enough memory on cpu" in strict.stderr
    assert "Settings that would fit: --batch-size 5" in strict.stderr
    assert "Traceback" not in strict.stderr


def test_fit_changes_tiling_when_the_batch_is_already_small(tiny_options, caplog):
    """At 5 frames a batch the fit keeps the batch (temporal context) and tiles the VAE."""
    import seedvr2
    from seedvr2.pipeline.runner import JobStats

    frames = torch.rand(5, 48, 64, 3)
    stats = JobStats()
    seedvr2.upscale(frames, **tiny_options, resolution=192, batch_size=5, stats=stats)
    tight = f"{(stats.estimated_bytes['cpu'] - 1) / GIB:.9f}"
    with caplog.at_level("WARNING", logger="seedvr2"):
        out = seedvr2.upscale(frames, **tiny_options, resolution=192, batch_size=5,
                              max_vram=float(tight), stats=stats)
    assert out.shape == (5, 192, 256, 3)
    assert stats.batch_size == 5
    assert re.search(r"fit=auto: .* running with vae_\w+_tiled=True, vae_\w+_tile_size=128 "
                     r"\(costs: VAE tiles: ", caplog.text), caplog.text
    with pytest.raises(mem.BudgetError,
                       match=r"; or vae_(en|de)code_tiled=True with vae_(en|de)code_tile_size=128 "):
        seedvr2.upscale(frames, **tiny_options, resolution=192, batch_size=5,
                        max_vram=float(tight), fit="strict")


def test_fit_job_order_batch_tiles_offload_swap():
    """On a GPU placement the budget's fit tries, in order: the batch (not below 5 frames
    here), VAE tiles, offloading, BlockSwap, then all of them at once; each change named with
    what it costs, and what it returns fits."""
    real = Budget(dit_config("3b"), vae_config("vae"), Weights.from_config("dit", "3b", 2),
                  Weights.from_config("vae", "vae", 2))
    job, place = mem.BatchShape(1080, 1920, 9), Placement()
    need = {size: mem.estimate(real, mem.BatchShape(1080, 1920, size), place).peak("cuda:0")
            for size in (5, 9)}
    cost = mem._COSTS

    def fitted(have):
        found = mem.fit_job(real, job, place, {"cuda:0": have}, 5)
        if found is not None:
            assert mem.fits(real, found.job, found.place, {"cuda:0": have})
        return found and (found.changes, found.costs)

    assert fitted(need[5]) == ((("batch_size", 5),), (cost["batch"],))
    assert fitted(need[5] - 1) == ((("vae_encode_tiled", True), ("vae_decode_tiled", True)),
                                   (cost["tiles"],))
    changes, costs = fitted(6 * GIB)
    assert changes[:4] == (("vae_encode_tiled", True), ("vae_decode_tiled", True),
                           ("vae_offload_device", "cpu"), ("dit_offload_device", "cpu"))
    assert changes[4][0] == "blocks_to_swap" and costs == (cost["tiles"], cost["offload"],
                                                           cost["swap"])
    assert fitted(1 << 20) is None  # nothing fits a MiB


MAX_VRAM_TEXT = st.one_of(
    st.text(max_size=12), st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-10 ** 30, max_value=10 ** 30).map(str),
    st.sampled_from(["-1", "nan", "inf", "-inf", "1e400", "-1e400", "1e6", "1000001", "0",
                     " 8 ", "8GiB", "", "0x10", "1_0", "\x00", "1e-400"]))


@given(st.one_of(MAX_VRAM_TEXT, st.floats(allow_nan=True, allow_infinity=True),
                 st.integers(min_value=-10 ** 30, max_value=10 ** 30), st.none(),
                 st.booleans()))
def test_max_vram_hostile_values(value):
    """Any value is a number of GiB in [0, 1e6] or an OptionError naming max_vram; never
    another exception, never NaN or infinity accepted."""
    result = outcome(lambda: resolve_options(max_vram=value).max_vram, "max_vram")
    if not result.refused:
        assert isinstance(result.value, float) and math.isfinite(result.value)
        assert 0 <= result.value <= 1e6


@given(MAX_VRAM_TEXT)
def test_max_vram_hostile_flag(text):
    """On the command line: one clean error naming --max-vram, or a value that is used."""
    from hostile import run_cli

    run = run_cli(["upscale", "in.mp4", "-o", "/nonexistent-dir/out.mp4", "--max-vram", text,
                   "--device", "cpu"])
    if run.status != 0:
        assert "max-vram" in run.stderr or "in.mp4" in run.stderr, run.stderr


@given(st.one_of(st.text(max_size=10), st.integers(), st.none(), st.booleans()))
def test_fit_hostile_values(value):
    result = outcome(lambda: resolve_options(fit=value).fit, "fit")
    if not result.refused:
        assert result.value in ("auto", "strict")


def test_a_fit_that_moves_a_model_loads_it_again(tiny_options, monkeypatch):
    """Offloading or BlockSwap chosen by a fit places the models differently: Job.prepare
    loads them again with the fitted options and checks those strictly (a CPU job is never
    offered offloading, so the fit is stood in for here)."""
    from seedvr2.pipeline import setup

    loads, checks = [], []
    load, prepare = setup.load_models, setup.prepare_job

    def counted_load(*args, opts, **kwargs):
        loads.append(opts.vae_offload_device)
        return load(*args, opts=opts, **kwargs)

    def fitting_prepare(models, opts, *args, **kwargs):
        checks.append(opts.fit)
        ready = prepare(models, opts, *args, **kwargs)
        return ready if opts.fit == "strict" else ready.replace(vae_offload_device="cpu")

    monkeypatch.setattr(setup, "load_models", counted_load)
    monkeypatch.setattr(setup, "prepare_job", fitting_prepare)
    opts = resolve_options(device="cpu", dtype="fp32", resolution=32, batch_size=5)
    job = setup.Job.build(opts, tiny_options["dit"], tiny_options["vae"],
                          tiny_options["model_dir"])
    models, ready = job.prepare(5, (32, 42))
    assert loads == ["none", "cpu"] and checks == ["auto", "strict"]
    assert (ready.vae_offload_device, ready.fit) == ("cpu", "auto")
    assert models.vae_offload == torch.device("cpu") and models.vae_placement is not None
