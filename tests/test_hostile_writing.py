"""Writing hostile sizes and rates (issue 33): H.265 narrower than libx265 survives is refused
before any frame is computed (checked under glibc's checking allocator, in a subprocess, since
what it guards against is a process abort); frame rates no video can have are refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, make_clip
from hostile import run_cli


def _cli_args(tiny_options, *extra):
    return ["upscale", "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
            "--model-dir", str(tiny_options["model_dir"]), "--device", "cpu", "--dtype", "fp32",
            "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
            "--batch-size", "5", "--quiet", *extra]


def test_narrow_h265_is_refused_before_any_work_under_a_checking_allocator(tiny_options,
                                                                          tmp_path):
    """Three 64x48 clips to 42x32 H.265 aborted the process (glibc: 'corrupted size vs.
    prev_size', status 134) after the outputs were in place."""
    folder = tmp_path / "clips"
    folder.mkdir()
    for name in ("a", "b", "c"):
        make_clip(folder / f"{name}.mp4", frames=5)
    out = tmp_path / "out"
    env = {**os.environ, "MALLOC_CHECK_": "3", "PYTHONPATH": str(REPO / "src"),
           "OMP_NUM_THREADS": "1"}
    code = "import sys; from seedvr2.cli import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", code, *_cli_args(
        tiny_options, str(folder), "-o", str(out), "--codec", "h265", "--resolution", "32")],
        capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1, run.stderr
    assert run.stderr == "".join(
        f"error: {out / name}.mp4: H.265 output must be at least 64 px wide, got 42x32 "
        f"(libx265 corrupts memory and aborts on narrower frames); use codec h264 or vp9, or "
        f"a larger resolution\n" for name in "abc") + \
        "error: 3 of 3 inputs failed: a.mp4, b.mp4, c.mp4\n"
    assert not out.exists() or list(out.iterdir()) == []


def test_narrow_h265_is_refused_before_a_frame_is_computed(tiny_options, tmp_path,
                                                           monkeypatch):
    from seedvr2.pipeline.runner import Upscaler

    def no_work(*args, **kwargs):
        raise AssertionError("a frame was computed before the output was opened")
    monkeypatch.setattr(Upscaler, "_encode", no_work)
    clip = tmp_path / "in.mp4"
    make_clip(clip, frames=5)
    run = run_cli(_cli_args(tiny_options, str(clip), "-o", str(tmp_path / "out.mkv"),
                            "--codec", "h265", "--resolution", "46"))
    assert run.status == 1 and "H.265 output must be at least 64 px wide, got 62x46" in \
        run.stderr
    assert list(tmp_path.iterdir()) == [clip]


def test_h265_at_the_minimum_width_is_written(tiny_options, tmp_path):
    import av

    clip = tmp_path / "in.mp4"
    make_clip(clip, frames=5)
    out = tmp_path / "out.mkv"
    assert run_cli(_cli_args(tiny_options, str(clip), "-o", str(out), "--codec", "h265",
                             "--resolution", "48")).status == 0
    with av.open(str(out)) as written:
        stream = written.streams.video[0]
        assert (stream.codec_context.name, stream.width, stream.height) == ("hevc", 64, 48)
        assert sum(1 for _ in written.decode(stream)) == 5


RANGE = "must be between 1/1000 and 1000 frames a second (what video containers and players " \
    "handle)"


@pytest.mark.parametrize("fps, problem", [
    ("1e9", RANGE), ("2000/1", RANGE), ("1/5000", RANGE),
    ("1_0", "expected auto, or a positive rate such as 24, 29.97 or 30000/1001"),
    ("²4", "expected auto, or a positive rate such as 24, 29.97 or 30000/1001"),
])
def test_frame_rates_no_video_can_have_are_refused(tmp_path, fps, problem):
    run = run_cli(["upscale", str(tmp_path / "in.png"), f"--fps={fps}"])
    assert run.status == 2 and run.stderr.endswith(f"error: --fps {fps}: {problem}\n")
