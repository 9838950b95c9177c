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
