"""Same seed, same frames: the same jobs run in two separate processes give identical frames,
bit for bit, at several sizes and batch layouts, through the file path (video with audio, as
the CLI runs it) and the in-memory one.

The two processes are made to differ in everything that should not matter: the second fills
freshly allocated and freed heap memory with a byte pattern (glibc's ``MALLOC_PERTURB_``), so
a computation that reads memory it never wrote gives other values there; hash seeds differ,
so anything ordered by string hashes changes order; and address-space layout differs
between processes anyway, so anything keyed by or sensitive to addresses (caches keyed by
``data_ptr()``, kernels whose rounding depends on operand alignment) shows up.

What this found (issue 13): the frames our pipeline computes were identical, but libx264's
macroblock-tree rate control reads memory it never wrote, so the encoded output changed from
run to run (``file_overlap`` frames 5, 6 and 8 here; the first batch in the report). The
writer turns mbtree off.

The same encoder made this test itself flaky on a busy machine (about 1 run in 3 under load):
each process used to encode its own input clips, with the encoder's defaults (mbtree on), and
under load the memory mbtree reads unwritten held other bytes, so ``file_ragged``'s input came
out different (Y/U/V up to 4 levels apart in all 11 frames); the tiny random-weight models
amplify that to 51 levels in every output frame. Our pipeline was deterministic: each run's
input, upscaled again, gave that run's output bit for bit. So the input clips are encoded
once, by the test, and both processes read the same bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

# Each job: name, source (frames, width, height), options. Sizes and layouts cover a ragged
# last batch, temporal overlap with blending, prepended frames, uniform batches, a non-integer
# scale and model offloading (the arena copies of memory.placement).
JOBS = [
    ("file_ragged", (11, 48, 32), dict(resolution=32, batch_size=5)),
    ("file_overlap", (10, 40, 24), dict(resolution=24, batch_size=9, temporal_overlap=2)),
    ("memory_prepend", (6, 36, 20), dict(resolution=30, batch_size=5, prepend_frames=3,
                                         uniform_batch_size=True)),
    ("memory_offload", (5, 32, 24), dict(resolution=30, batch_size=5, dit_offload_device="cpu",
                                         vae_offload_device="cpu")),
]

# One job list run in a fresh process; its in-memory jobs' frames come from
# determinism_sources.testsrc2, the file jobs' clips were encoded by the test (see the docstring).
WORKER = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import numpy as np
    import torch

    import seedvr2
    from determinism_sources import testsrc2
    from seedvr2.io import open_media

    models, out, jobs = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    inputs = Path(sys.argv[4])
    common = dict(dit=str(models / "dit3b_tiny.safetensors"),
                  vae=str(models / "vae_tiny.safetensors"), model_dir=models,
                  text_embeddings=str(models / "text_64.safetensors"), device="cpu",
                  dtype="fp32", seed=3)

    results = {}
    for name, (count, width, height), options in jobs:
        if name.startswith("file"):
            dst = seedvr2.upscale_file(inputs / f"{name}.mp4", out / f"{name}_out.mp4",
                                       **common, **options)
            with open_media(dst) as media:
                results[name] = np.stack(list(media.frames()))
        else:
            frames = testsrc2(count, width, height)
            results[name] = seedvr2.upscale(torch.from_numpy(np.stack(frames)),
                                            **common, **options).numpy()
    np.savez(out / "frames.npz", **results)
""")


def _encode_inputs(folder: Path) -> Path:
    """The file jobs' input clips, encoded once in this process: ``folder/<job>.mp4``."""
    from determinism_sources import clip, testsrc2

    folder.mkdir()
    for name, (count, width, height), _ in JOBS:
        if name.startswith("file"):
            clip(folder / f"{name}.mp4", testsrc2(count, width, height))
    return folder


def _run(tmp: Path, models: Path, inputs: Path, env_extra: dict) -> dict:
    import json

    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_PERTURB_", "PYTHONHASHSEED")}
    env.update(env_extra, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "tests")]))
    done = subprocess.run([sys.executable, "-c", WORKER, str(models), str(tmp), json.dumps(JOBS),
                           str(inputs)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp / "frames.npz") as data:
        return {k: data[k] for k in data.files}


def test_same_jobs_in_two_processes_give_identical_frames(tiny_model_dir, tmp_path):
    inputs = _encode_inputs(tmp_path / "inputs")
    first = _run(tmp_path / "first", tiny_model_dir, inputs, {"PYTHONHASHSEED": "1"})
    second = _run(tmp_path / "second", tiny_model_dir, inputs,
                  {"PYTHONHASHSEED": "2", "MALLOC_PERTURB_": "165"})
    assert sorted(first) == sorted(name for name, *_ in JOBS)
    for name, _, _ in JOBS:
        a, b = first[name], second[name]
        assert a.shape == b.shape, name
        differ = np.argwhere((a != b).reshape(len(a), -1).any(1)).ravel().tolist()
        assert differ == [], f"{name}: frames {differ} differ between the two runs " \
                             f"({int((a != b).sum())} values)"


# ---------------------------------------------------------------------------------------------
# Thread counts: one process on 2 threads and two ranks on 1 thread each must compute the same
# bits (issue 33). oneDNN's 1x1x1 convolution splits its channel sum by the thread count at the
# VAE's real widths (256-512 channels; the tiny VAE is too narrow to show it).

def test_pointwise_vae_convolutions_do_not_depend_on_the_thread_count():
    import torch
    import torch.nn.functional as F

    from conftest import rounding_bound
    from seedvr2.models.vae_blocks import CausalConv3d, Upsample3D

    torch.manual_seed(0)
    shortcut = CausalConv3d(256, 512, 1)
    upsample = Upsample3D(256, temporal=True)
    x = torch.randn(1, 256, 3, 32, 32)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                results.append((shortcut(x), upsample(x)))
    finally:
        torch.set_num_threads(before)
    (one, up_one), (two, up_two) = results
    assert torch.equal(one, two) and torch.equal(up_one, up_two)
    reference = F.conv3d(x.double(), shortcut.weight.double(), shortcut.bias.double()).float()
    assert (one - reference).abs().max() <= rounding_bound(reference, terms=256)


# Pointwise functions: PyTorch's CPU kernels for SiLU, sigmoid, GELU and powers compute most
# elements with vector code and the end of each thread's share with scalar code, which rounds
# differently; where the shares meet depends on the thread count (issue 44). models.pointwise
# gives the same bits on either path: a strided input, which takes the scalar path for every
# element, gives the same values as a contiguous one, so no split of the work can change them.

@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
def test_pointwise_functions_give_the_same_bits_on_the_vector_and_scalar_paths(torch_threads):
    import torch
    import torch.nn.functional as F

    from seedvr2.models.pointwise import gelu_tanh, power, sigmoid, silu

    x = torch.randn(100_003, generator=torch.Generator().manual_seed(0)) * 4
    wide = torch.empty(2 * len(x))
    wide[::2] = x
    strided = wide[::2]
    assert torch.equal(x, strided) and not F.silu(x).equal(F.silu(strided))  # torch's own differ
    functions = dict(silu=silu, silu_in_place=lambda v: silu(v.clone(), inplace=True),
                     sigmoid=sigmoid, gelu_tanh=gelu_tanh,
                     **{f"power {p:.3g}": lambda v, p=p: power(v.abs(), p) for p in (2.4, 1 / 3)})
    for name, fn in functions.items():
        assert torch.equal(fn(x), fn(strided)), name
    assert torch.equal(silu(x), silu(x.clone(), inplace=True))


def test_lab_colour_correction_does_not_depend_on_the_thread_count():
    """Its sRGB and CIELAB transfer curves are powers (found by 1 vs 2 threads: 47 values of
    these frames differed)."""
    import torch

    from seedvr2.pipeline.color import color_correct

    g = torch.Generator().manual_seed(0)
    content = torch.rand(5, 3, 50, 66, generator=g) * 2 - 1
    style = (content + 0.1 * torch.randn(content.shape, generator=g)).clamp(-1, 1)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(color_correct(content, style, "lab"))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)


def test_one_process_and_two_ranks_give_identical_frames_with_default_threads(tiny_options,
                                                                             tmp_path):
    """The CLI on a scene-cut clip: one process on the machine's default thread count (2 on
    2 cores) and two gloo ranks of 1 thread each write the same PNG frames (issue 44). Lab
    colour correction and an output of 50 x 66 put the threads' shares mid-vector."""
    import av

    from seedvr2.io import open_media
    from test_scene_cuts import cut_clip

    (tmp_path / "in").mkdir()
    for i, frame in enumerate(cut_clip()[:13]):  # a cut at frame 7
        av.VideoFrame.from_ndarray(frame, format="rgb24").to_image().save(
            tmp_path / "in" / f"{i:03d}.png")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    frames = []
    for name, devices in (("one", ["--device", "cpu"]), ("two", ["--devices", "cpu,cpu"])):
        done = subprocess.run(
            [sys.executable, "-m", "seedvr2", "upscale", str(tmp_path / "in" / "%03d.png"),
             "-o", f"{tmp_path / name}/", "--quiet", "--dit", tiny_options["dit"], "--vae",
             tiny_options["vae"], "--model-dir", str(tiny_options["model_dir"]),
             "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
             "--dtype", "fp32", "--resolution", "50", "--batch-size", "5",
             "--color-correction", "lab", "--dist-timeout", "30", *devices],
            capture_output=True, text=True, cwd=REPO, timeout=300,
            env=dict(env, GLOO_SOCKET_IFNAME="lo"))
        assert done.returncode == 0, done.stderr[-3000:]
        with open_media(f"{tmp_path / name}/%05d.png") as media:
            frames.append(np.stack(list(media.frames())))
    one, two = frames
    assert one.shape == (13, 50, 66, 3)
    differ = np.argwhere((one != two).reshape(len(one), -1).any(1)).ravel().tolist()
    assert differ == [], f"frames {differ} differ ({int((one != two).sum())} values)"


def test_frames_do_not_depend_on_the_thread_count(tiny_options):
    """One process on 1 and on 3 threads (3 shares split the tiny VAE's 16 and 32 channels
    mid-vector): the same frames, bit for bit. Before models.pointwise, 81,641 values
    differed, 4 of 13 frames by one 8-bit level."""
    import torch

    import seedvr2
    from test_scene_cuts import cut_clip

    frames = torch.from_numpy(cut_clip()[:13])
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results.append(seedvr2.upscale(frames, **tiny_options, resolution=50, batch_size=5,
                                           color_correction="lab", seed=3))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)
