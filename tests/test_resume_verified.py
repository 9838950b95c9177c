"""Resume verifies what it kept and keeps it at a fine grain: a damaged, truncated or
replaced piece of a killed job is named and computed again (the file equals an
uninterrupted run's), parts of the segment being written are kept every checkpoint interval
(so short clips resume), and a second job on the same output is refused while the first
runs. The jobs run through the command line, killed by the harness of test_resume.py."""

from __future__ import annotations

import re
import sys
import shutil
import signal

import numpy as np
import pytest

from conftest import make_clip
from test_resume import _cli, _frames

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PARTS = {"SEEDVR2_CHECKPOINT_SECONDS": "0"}  # a part at every chunk's end (one batch each)


def _reused(result, total: int = 6) -> int:
    found = re.search(rf"(\d+) of {total} batches reused", result.stdout + result.stderr)
    assert found, result.stdout[-2000:] + result.stderr[-2000:]
    return int(found.group(1))


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("verified") / "clip.mp4"
    make_clip(path, frames=23)
    return path


@pytest.fixture(scope="module")
def whole(clip, tiny_options, tmp_path_factory):
    """The uninterrupted run's file (three segments of two batches)."""
    out = tmp_path_factory.mktemp("whole") / "up.mp4"
    result = _cli(tiny_options, clip, out)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def killed(clip, tiny_options, tmp_path_factory):
    """A job killed once the journal names two segments; returns (output, a pristine copy of
    its state folder). Each test puts the copy back before damaging it."""
    out = tmp_path_factory.mktemp("killed") / "up.mp4"
    result = _cli(tiny_options, clip, out, env={"SEEDVR2_KILL_AT": "journal:2"})
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    state = out.parent / ".up.mp4.seedvr2-resume"
    pristine = out.parent.parent / "pristine-state"
    shutil.copytree(state, pristine)
    return out, pristine


def _restore(out, pristine):
    state = out.parent / ".up.mp4.seedvr2-resume"
    shutil.rmtree(state, ignore_errors=True)
    out.unlink(missing_ok=True)
    shutil.copytree(pristine, state)
    return state


def _overwrite_inside(path):
    """200 bytes in the middle of the coded frames (an MP4's ``mdat`` box: not the x264
    banner at its start, nor the index after it), or of the file."""
    data = bytearray(path.read_bytes())
    start, stop = 0, len(data)
    if b"mdat" in data:
        start = data.index(b"mdat") + 4
        stop = start - 8 + int.from_bytes(data[start - 8: start - 4], "big")
    middle = (start + stop) // 2 - 100
    data[middle: middle + 200] = bytes(range(200))
    path.write_bytes(bytes(data))


def _cut_to_two_thirds(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def _folder_instead(path):
    path.unlink()
    path.mkdir()
    (path / "x").write_bytes(b"x")


DIFFERS = "differs from the SHA-256 the journal recorded when it was closed (damaged or changed)"


@pytest.mark.parametrize("damage,piece,message,reused", [
    (_overwrite_inside, "seg-00001.mp4", DIFFERS, 1),
    (_cut_to_two_thirds, "seg-00001.mp4", DIFFERS, 1),
    (_folder_instead, "seg-00001.mp4", DIFFERS, 1),
    (_overwrite_inside, "seg-00000.mp4", DIFFERS, 0),
], ids=["bytes-overwritten", "truncated", "folder", "first-segment"])
def test_damaged_segment_is_named_and_computed_again(clip, tiny_options, whole, killed, damage,
                                                      piece, message, reused):
    """The damaged segment and everything after it are computed again; the batch before it
    is computed again for its blend tail (so one batch fewer is reused than kept before it)."""
    out, pristine = killed
    state = _restore(out, pristine)
    damage(state / piece)
    again = _cli(tiny_options, clip, out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resume: {piece} in {state} {message}" in again.stderr, again.stderr[-3000:]
    assert _reused(again) == reused
    assert np.array_equal(_frames(out), _frames(whole))
    assert out.read_bytes() == whole.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["up.mp4"]


def test_damaged_blend_tail_is_computed_again(clip, tiny_options, whole, killed):
    out, pristine = killed
    state = _restore(out, pristine)
    tail, = state.glob("tail-*.npy")
    tail.write_bytes(b"garbage" * 40)
    again = _cli(tiny_options, clip, out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (f"resume: the blend tail {tail.name} in {state} cannot be used (differs from the "
            f"SHA-256 the journal recorded); the last kept chunk is computed again for it"
            in again.stderr), again.stderr[-3000:]
    assert _reused(again) == 3  # batch 4 (the last kept) is computed again for its tail
    assert out.read_bytes() == whole.read_bytes()


def test_truncated_matroska_segment_is_computed_again(clip, tiny_options, tmp_path):
    """Before: a Matroska segment cut short was joined as it was (fewer frames, exit 0)."""
    whole_mkv = tmp_path / "whole.mkv"
    assert _cli(tiny_options, clip, whole_mkv).returncode == 0
    out = tmp_path / "up.mkv"
    killed = _cli(tiny_options, clip, out, env={"SEEDVR2_KILL_AT": "journal:2"})
    assert killed.returncode == -signal.SIGKILL
    state = tmp_path / ".up.mkv.seedvr2-resume"
    _cut_to_two_thirds(state / "seg-00001.mkv")
    again = _cli(tiny_options, clip, out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resume: seg-00001.mkv in {state} {DIFFERS}" in again.stderr
    resumed = _frames(out)
    assert resumed.shape[0] == 23
    assert np.array_equal(resumed, _frames(whole_mkv))


def test_truncated_png_in_sequence_segment_is_computed_again(clip, tiny_options, tmp_path):
    """Before: every re-run failed reading the PNG ("image file is truncated")."""
    assert _cli(tiny_options, clip, f"{tmp_path}/whole/").returncode == 0
    killed = _cli(tiny_options, clip, f"{tmp_path}/frames/", env={"SEEDVR2_KILL_AT": "journal:2"})
    assert killed.returncode == -signal.SIGKILL
    state = tmp_path / ".frames.seedvr2-resume"
    png = sorted((state / "seg-00001").iterdir())[1]
    _cut_to_two_thirds(png)
    again = _cli(tiny_options, clip, f"{tmp_path}/frames/")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resume: seg-00001 in {state} {DIFFERS}" in again.stderr
    assert np.array_equal(_frames(f"{tmp_path}/frames/%05d.png"),
                          _frames(f"{tmp_path}/whole/%05d.png"))


@pytest.fixture(scope="module")
def one_segment(clip, tiny_options, tmp_path_factory):
    """The clip's file with the default segment length: a single segment, no parts (the
    checkpoint interval is a minute)."""
    out = tmp_path_factory.mktemp("one") / "up.mp4"
    result = _cli(tiny_options, clip, out, env={"SEEDVR2_SEGMENT_FRAMES": "96"})
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def test_short_clip_resumes_from_parts(clip, tiny_options, tmp_path, one_segment):
    """Before: a plan of one segment was written directly and a killed job computed every
    batch again. Now parts of the open segment are kept at chunk ends (every chunk here:
    interval 0), and the segment is encoded again from them: the same bytes as a run that
    kept no part at all."""
    out = tmp_path / "up.mp4"
    env = {"SEEDVR2_SEGMENT_FRAMES": "96", **PARTS}
    killed = _cli(tiny_options, clip, out, env={**env, "SEEDVR2_KILL_AT": "part:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    state = tmp_path / ".up.mp4.seedvr2-resume"
    assert sorted(p.name for p in state.glob("part-*")) == [
        "part-000000.raw", "part-000001.raw", "part-000002.raw"]
    again = _cli(tiny_options, clip, out, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _reused(again) == 3
    assert out.read_bytes() == one_segment.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up.mp4"]


def test_damaged_part_is_computed_again(clip, tiny_options, tmp_path, one_segment):
    out = tmp_path / "up.mp4"
    env = {"SEEDVR2_SEGMENT_FRAMES": "96", **PARTS}
    killed = _cli(tiny_options, clip, out, env={**env, "SEEDVR2_KILL_AT": "part:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    state = tmp_path / ".up.mp4.seedvr2-resume"
    _overwrite_inside(state / "part-000001.raw")
    again = _cli(tiny_options, clip, out, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resume: part-000001.raw in {state} {DIFFERS}; it is computed again" in again.stderr
    assert _reused(again) == 0  # part 0's batch is computed again for its blend tail
    assert out.read_bytes() == one_segment.read_bytes()


def test_second_job_on_the_same_output_is_refused(clip, tiny_options, tmp_path):
    """A live job locks its resume folder; another job writing the same output is refused
    naming it, and leaves the folder alone (before, it took the folder over and the first
    job failed)."""
    import os

    from seedvr2.io import open_media
    from seedvr2.options import resolve_options
    from seedvr2.pipeline.plan import make_plan
    from seedvr2.pipeline.identity import job_identity, model_refs, source_digest
    from seedvr2.pipeline.resume import open_resume_state
    from seedvr2.io.files import FileOutput

    out = tmp_path / "up.mp4"
    opts = resolve_options(resolution=32, batch_size=5, temporal_overlap=1, dtype="fp32",
                           text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))
    with open_media(clip) as reader:
        models = model_refs(tiny_options["dit"], tiny_options["vae"], tiny_options["model_dir"])
        first = open_resume_state(reader, FileOutput(out, (32, 42), 8, "h264"),
                                  make_plan(23, opts.replace(scene_cuts="off")),
                                  job_identity(opts, source_digest(reader), models),
                                  __import__("torch").float32, fresh=False)
    assert first is not None
    try:
        second = _cli(tiny_options, clip, out)
        assert second.returncode == 1, second.stderr[-2000:]
        assert re.search(
            rf"error: another job is writing {re.escape(str(out))} \(process {os.getpid()} on "
            rf"\S+, started [0-9T:+-]+: {re.escape(' '.join(sys.argv))}\): its resume folder "
            rf"{re.escape(str(first.folder))} is in use\. Wait for it to finish \(or stop it\), "
            rf"or choose another output name", second.stderr), second.stderr[-2000:]
        assert first.folder.is_dir() and (first.folder / "owner.json").is_file()
        assert not out.exists()
    finally:
        first.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
