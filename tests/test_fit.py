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
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from seedvr2.memory import budget as mem
from seedvr2.memory.budget import GIB, Budget, Placement, Weights
from seedvr2.models.config import dit_config, vae_config
from seedvr2.options import resolve_options

from conftest import REPO, make_clip
from hostile import outcome

# 23 frames in batches of 5 overlapping by 1 (test_resume.py's plan): six batches, three
# segments of two batches each with segments of at least 8 frames.
SEGMENT_ENV = {"SEEDVR2_SEGMENT_FRAMES": "8"}
SIZE = (32, 42)  # the output of the 64x48 clip at resolution 32 (H, W)


def _need(tiny_options, batch: int) -> int:
    """The budget's peak on the CPU for the test's job at ``batch`` frames per batch, from the
    weight files' headers (as a job computes it)."""
    from seedvr2.memory.fit import batch_shape

    dit, dit_cfg = Weights.from_file(tiny_options["dit"], "dit", torch.float32)
    vae, vae_cfg = Weights.from_file(tiny_options["vae"], "vae", torch.float32)
    opts = resolve_options(device="cpu", dtype="fp32", resolution=32, batch_size=batch,
                           temporal_overlap=min(1, batch - 1))
    job = batch_shape(opts, SIZE, batch, torch.float32, mem.TEXT_TOKENS, {"cpu"})
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
            assert mem.fits(real, found.shape, found.place, {"cuda:0": have})
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


def test_a_fit_that_moves_a_model_loads_each_model_once(tiny_options, monkeypatch):
    """The fit is decided before any model loads (from the weight files' headers), so a job
    whose fit offloads the VAE loads each model once, placed as the fit says (a CPU job is
    never offered offloading: the budget's fit and check are stood in for here)."""
    import seedvr2
    from seedvr2.loading import load as loader
    from seedvr2.pipeline.runner import JobStats

    loads, load = [], loader._load
    monkeypatch.setattr(loader, "_load", lambda path, kind, *args, **kwargs: (
        loads.append(kind), load(path, kind, *args, **kwargs))[1])
    monkeypatch.setattr(mem, "fit_job", lambda budget, shape, place, available, lowest=1: mem.Fit(
        (("vae_offload_device", "cpu"),), shape, replace(place, vae_offload="cpu"), ("offload",)))
    monkeypatch.setattr(mem, "check", lambda budget, shape, place, available, **kwargs:
                        mem.estimate(budget, shape, place))
    stats = JobStats()
    out = seedvr2.upscale(torch.rand(5, 48, 64, 3), **tiny_options, resolution=32, batch_size=5,
                          cache_dit=False, cache_vae=False, max_vram=0.01, stats=stats)
    assert out.shape == (5, 32, 42, 3) and sorted(loads) == ["dit", "vae"]


@pytest.mark.parametrize("batch", [9, "auto"])
def test_a_fit_proposes_no_batch_at_or_below_the_temporal_overlap(tiny_options, cap, batch):
    """Batches of 9 overlapping by 6 over a cap that fits 5: fit auto does not lower the batch
    to 5, which the option check would refuse blaming the user; it refuses naming what is
    possible, and fit strict suggests no such batch either (issue 44)."""
    import seedvr2

    frames = torch.rand(23, 48, 64, 3)
    for fit in ("auto", "strict"):
        with pytest.raises(mem.BudgetError) as refused:
            seedvr2.upscale(frames, **tiny_options, resolution=32, batch_size=batch,
                            temporal_overlap=6, max_vram=float(cap), fit=fit)
        assert "batch_size=5" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("torch_threads", [1], indirect=True)  # as each worker runs
def test_two_ranks_fit_as_one_process_does(tiny_options, cap, monkeypatch, torch_threads):
    """With two CPU ranks, batches of 9 over a cap that fits 5 run batch 5 on every rank,
    the frames of one process's batch-5 job (issue 44: the batch was fixed before fitting
    and each rank refused)."""
    import seedvr2

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    frames = torch.rand(13, 48, 64, 3)
    options = dict(tiny_options, resolution=32, temporal_overlap=1, dist_timeout=30)
    one = seedvr2.upscale(frames, **options, batch_size=5)
    two = seedvr2.upscale(frames.clone(), **options, batch_size=9, max_vram=float(cap),
                          devices="cpu,cpu")
    assert torch.equal(two, one)


def test_a_rank_failure_is_named_in_words(tmp_path):
    """The launcher's error gives a rank's message, not the exception's class path."""
    import pickle
    from types import SimpleNamespace

    from seedvr2.distributed.launch import _failure

    files = []
    for text in ("Traceback ...\nseedvr2.memory.budget.BudgetError: not enough memory on cpu",
                 "Traceback ...\nbuiltins.ZeroDivisionError: division by zero"):
        files.append(tmp_path / f"error{len(files)}")
        files[-1].write_bytes(pickle.dumps(text))
    workers = SimpleNamespace(processes=[SimpleNamespace(exitcode=1)] * 2, error_files=files)
    assert [str(_failure(workers, rank)) for rank in (0, 1)] == [
        "distributed upscale failed on rank 0: not enough memory on cpu",
        "distributed upscale failed on rank 1: ZeroDivisionError: division by zero"]


def test_max_vram_caps_the_accelerators_not_the_host():
    """A VAE on the CPU beside a DiT on a GPU: max_vram caps the GPU only, the CPU plans
    within its RAM (issue 42); with no accelerator the cap is on the CPU, as before; a device
    whose memory is unknown plans within the cap."""
    from seedvr2.memory.fit import capped

    assert capped({"cpu": 100 * GIB}, {"cuda:0", "cpu"}, 1.0) == {"cpu": 100 * GIB,
                                                                   "cuda:0": GIB}
    assert capped({"cpu": 100 * GIB, "cuda:0": 50 * GIB}, {"cuda:0", "cpu"}, 1.0) == {
        "cpu": 100 * GIB, "cuda:0": GIB}
    assert capped({"cpu": 100 * GIB}, {"cpu"}, 1.0) == {"cpu": GIB}
    assert capped({"cpu": 100 * GIB}, {"cpu"}, 0.0) == {"cpu": 100 * GIB}


def test_the_int8_cache_is_offered_where_it_is_enough():
    """3B 1080p x 21 coded in temporal slices: with room for the VAE's tails in int8 (on
    the GPU, or parked on the host) ``vae_int8_cache`` is among the single changes that fit,
    the least of it offered; a fit to it names the option and its cost (before, no fit or
    suggestion ever proposed the cache the budget counts)."""
    real = Budget(dit_config("3b"), vae_config("vae"), Weights.from_config("dit", "3b", 2),
                  Weights.from_config("vae", "vae", 2))
    job, place = mem.BatchShape(1080, 1920, 21, encode_slice=5, decode_slice=4), Placement()
    need = {mode: mem.estimate(real, replace(job, vae_int8_cache=mode), place).peak("cuda:0")
            for mode in ("off", "on", "host")}
    assert need["off"] > need["on"] > need["host"]
    for mode in ("on", "host"):
        offered = mem.alternatives(real, job, place, {"cuda:0": need[mode]}, 21)
        assert f"vae_int8_cache={mode}" in offered, offered
    found = mem._fit(job, place, replace(job, vae_int8_cache="host"), place)
    assert (found.changes, found.costs) == ((("vae_int8_cache", "host"),), (mem._COSTS["int8"],))
