"""An output that is the job's input (the same file by any path) is refused, whatever the
flags, before any model loads: through the command line, the library and ComfyUI's Upscale
Video File node. The input is left as it was."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, make_clip

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# A model file that does not exist: were the models loaded, the job would fail naming it.
MISSING_DIT = "missing_dit.safetensors"


@pytest.fixture
def clip(tmp_path):
    path = tmp_path / "same.mp4"
    make_clip(path, frames=3)
    return path


def _upscale(*args, cwd):
    cmd = [sys.executable, "-m", "seedvr2", "upscale", *map(str, args), "--dit", MISSING_DIT,
           "--device", "cpu", "--resolution", "32"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.mark.parametrize("flags", [["--overwrite"], []])
def test_cli_refuses_the_input_as_output(clip, tmp_path, flags):
    before = clip.read_bytes()
    result = _upscale("same.mp4", "-o", "same.mp4", *flags, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (
        "error: same.mp4 is the job's input: writing the output there would destroy it, with "
        "or without overwrite; choose another output name")
    assert clip.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same.mp4"]


def _other_path(kind: str, clip, tmp_path):
    if kind == "symlink":
        (tmp_path / "link.mp4").symlink_to(clip)
        return tmp_path / "link.mp4"
    if kind == "hard link":
        os.link(clip, tmp_path / "hard.mp4")
        return tmp_path / "hard.mp4"
    if kind == "dot":
        return f".{os.sep}{clip.name}"
    (tmp_path / "sub").mkdir()
    return tmp_path / "sub" / ".." / clip.name


@pytest.mark.parametrize("kind", ["symlink", "hard link", "dot", "dotdot"])
def test_library_refuses_the_input_by_any_path(clip, tmp_path, monkeypatch, kind):
    from seedvr2.api import upscale_file
    from seedvr2.io import MediaError

    monkeypatch.chdir(tmp_path)
    before = clip.read_bytes()
    dst = _other_path(kind, clip, tmp_path)
    with pytest.raises(MediaError) as raised:
        upscale_file(clip, dst, MISSING_DIT, overwrite=True, device="cpu", resolution=32)
    message = str(raised.value)
    assert message.startswith(f"{dst} is the job's input")
    if kind in ("symlink", "hard link"):  # other names; "." and ".." spell the same one
        assert f"(the same file as the input {clip})" in message
    assert clip.read_bytes() == before
    assert not list(tmp_path.glob(".*partial*"))


def test_sequence_output_folder_holding_the_input_frames_is_refused(tmp_path):
    """A PNG sequence output replaces the numbered PNGs of its folder: the sequence read from
    that folder would be replaced frame by frame."""
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(3):
        Image.fromarray(np.full((24, 32, 3), 40 * i, np.uint8)).save(frames / f"{i:05d}.png")
    before = {p.name: p.read_bytes() for p in frames.iterdir()}
    result = _upscale("frames/%05d.png", "-o", "frames/", "--overwrite", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (
        f"error: frames/: the output would replace the input frames{os.sep}00000.png, with or "
        f"without overwrite; choose another output folder")
    assert {p.name: p.read_bytes() for p in frames.iterdir()} == before


def test_folder_job_checks_each_output_against_every_input(tmp_path):
    """``upscale in/ -o in/``: every output is one of the inputs; nothing is written."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("a.mp4", "b.mp4"):
        make_clip(folder / name, frames=3)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    result = _upscale("in", "-o", "in", "--overwrite", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: in{os.sep}{name} is the job's input: writing the output there would destroy "
        f"it, with or without overwrite; choose another output name" for name in ("a.mp4", "b.mp4")
    ] + ["error: 2 of 2 inputs failed: a.mp4, b.mp4"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_check_file_job_refuses_another_input_of_the_folder_job(tmp_path):
    """In a folder job an output must not be any input still to be read (the cross check)."""
    from seedvr2.api import check_file_job
    from seedvr2.io import MediaError
    from seedvr2.options import resolve_options

    first, second = tmp_path / "a.mp4", tmp_path / "b.mp4"
    make_clip(first, frames=3)
    make_clip(second, frames=3)
    opts = resolve_options(resolution=32)
    with pytest.raises(MediaError, match=r"b\.mp4 is the job's input"):
        check_file_job(first, second, opts, "h264", True, [first, second])
    check_file_job(first, second, opts, "h264", True, [first])  # no other input: allowed


def test_upscale_video_file_node_refuses_its_input(clip, tiny_model_dir, tmp_path):
    """The node's output name comes from the host; a host naming the input is refused by the
    library's check before the models load."""
    from seedvr2.workflow import nodes as defs
    from seedvr2.workflow.host import HeadlessHost

    class NamesTheInput(HeadlessHost):
        def output_file(self, prefix, suffix, width, height):
            return clip, {"filename": clip.name, "subfolder": "", "type": "output"}

    nodes = {n.id: n for n in defs.build_nodes()}
    host = NamesTheInput(model_dir=tiny_model_dir, input_dir=clip.parent, output_dir=tmp_path,
                         quiet=True)
    handles = [nodes[node].run(host, model=model, **{
        **{s.input: s.node_input().default for s in defs.LOADER_SETTINGS[kind]
           if not s.node_input().optional}, "device": "cpu", "dtype": "fp32"}).outputs[0]
        for node, kind, model in (("SeedVR2LoadDiTModel", "dit", "dit3b_tiny.safetensors"),
                                  ("SeedVR2LoadVAEModel", "vae", "vae_tiny.safetensors"))]
    node = nodes["SeedVR2UpscaleVideoFile"]
    inputs = {i.name: i.default for i in node.inputs if i.is_widget}
    inputs.update(resolution=32, video_path=clip.name, codec="h264")
    before = clip.read_bytes()
    with pytest.raises(ValueError, match=r"same\.mp4 is the job's input: writing the output"):
        node.run(host, dit=handles[0], vae=handles[1], **inputs)
    assert clip.read_bytes() == before
