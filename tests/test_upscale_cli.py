"""``seedvr2 upscale`` end to end on the CPU with the tiny models: real files in, real files out."""

from __future__ import annotations

import os
import subprocess
import sys

import av
import numpy as np
import pytest

from seedvr2.cli import main
from seedvr2.io import open_media

from conftest import FPS, N, REPO, make_clip


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    make_clip(path)  # 60 frames, 64x48, 29.97 fps, AAC audio
    return path


def _args(tiny_options, *extra):
    return ["upscale", "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
            "--model-dir", str(tiny_options["model_dir"]), "--device", "cpu", "--dtype", "fp32",
            "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
            "--resolution", "64", "--batch-size", "9", "--quiet", *extra]


def _frames(path):
    with open_media(path) as media:
        return np.stack(list(media.frames()))


def test_video_with_audio(clip, tiny_options, tmp_path):
    out = tmp_path / "out.mp4"
    assert main(_args(tiny_options, str(clip), "-o", str(out))) == 0
    with av.open(str(out)) as container:
        video = container.streams.video[0]
        assert (video.width, video.height) == (86, 64)
        assert video.average_rate == FPS
        assert len(container.streams.audio) == 1
    assert _frames(out).shape == (N, 64, 86, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.mp4"]  # no temporary left


def test_same_seed_same_frames_any_chunking(clip, tiny_options, tmp_path):
    # Lossless PNG sequences compare the pipeline's frames exactly.
    first, second = tmp_path / "a", tmp_path / "b"
    assert main(_args(tiny_options, str(clip), "-o", f"{first}/", "--seed", "3",
                      "--temporal-overlap", "2")) == 0
    assert main(_args(tiny_options, str(clip), "-o", f"{second}/", "--seed", "3",
                      "--temporal-overlap", "2", "--chunk-size", "40")) == 0
    a, b = _frames(first), _frames(second)
    assert a.shape == (N, 64, 86, 3)
    assert np.array_equal(a, b)


def test_existing_output_is_kept(clip, tiny_options, tmp_path, capsys):
    out = tmp_path / "out.mp4"
    out.write_bytes(b"precious")
    assert main(_args(tiny_options, str(clip), "-o", str(out))) == 1
    assert out.read_bytes() == b"precious"
    assert "overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("extra,message", [
    (["--batch-size", "8"], "error: --batch-size 8: must be 4n+1"),
    (["--color-correction", "sepia"], "invalid choice: 'sepia'"),
])
def test_bad_options(clip, tiny_options, tmp_path, extra, message):
    result = subprocess.run([sys.executable, "-m", "seedvr2", *_args(tiny_options, str(clip)), *extra],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert message in result.stderr


def test_the_facade_takes_the_options_the_command_resolved(clip, tiny_options, tmp_path,
                                                             monkeypatch):
    import seedvr2.api
    from seedvr2.options import OPTIONS

    calls = []

    def upscale_file(src, dst, dit=None, vae=None, *, opts=None, **keywords):
        calls.append((opts, keywords))

    monkeypatch.setattr(seedvr2.api, "upscale_file", upscale_file)
    assert main(_args(tiny_options, str(clip), "-o", str(tmp_path / "out.mp4"))) == 0
    [(opts, keywords)] = calls
    assert (opts.resolution, opts.batch_size, opts.device) == (64, 9, "cpu")
    assert not keywords.keys() & OPTIONS.keys()  # nothing left for the facade to resolve again


def test_the_facade_refuses_options_given_twice(tmp_path):
    import seedvr2
    from seedvr2.options import resolve_options

    with pytest.raises(TypeError, match=r"options given both as opts= and as keywords "
                                        r"\(resolution\); give one"):
        seedvr2.upscale_file(tmp_path / "in.mp4", tmp_path / "out.mp4",
                             opts=resolve_options(), resolution=720)


def test_bad_inputs_leave_nothing(tiny_options, tmp_path, capsys):
    missing = tmp_path / "missing.mp4"
    assert main(_args(tiny_options, str(missing), "-o", str(tmp_path / "o.mp4"))) == 1
    assert "missing.mp4" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100)
    assert main(_args(tiny_options, str(corrupt), "-o", str(tmp_path / "o.mp4"))) == 1
    assert "corrupt.mp4" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.mp4"]


def _still(folder, name):
    """A 64x48 PNG named ``name`` (the tiny models upscale it in a second)."""
    from PIL import Image

    from conftest import clip_frame

    path = folder / name
    Image.fromarray(clip_frame(3)).save(path)
    return path


def test_a_reader_gone_from_stdout_does_not_fail_a_finished_job(tiny_options, tmp_path):
    """``seedvr2 upscale ... | head -c 0``: the summary has no reader; the job succeeded."""
    source, out = _still(tmp_path, "still.png"), tmp_path / "out.png"
    args = [a for a in _args(tiny_options, str(source), "-o", str(out)) if a != "--quiet"]
    child = subprocess.Popen([sys.executable, "-m", "seedvr2", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=REPO)
    child.stdout.close()  # the reader leaves before the summary is printed
    err = child.stderr.read().decode()
    assert child.wait() == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert _frames(out).shape == (1, 64, 86, 3)


def test_names_stdout_cannot_encode_print_with_replacements(tiny_options, tmp_path):
    source, out = _still(tmp_path, "clé.png"), tmp_path / "sortie_été.png"
    args = [a for a in _args(tiny_options, str(source), "-o", str(out)) if a != "--quiet"]
    result = subprocess.run([sys.executable, "-m", "seedvr2", *args], capture_output=True,
                            cwd=REPO, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode("ascii").startswith(str(tmp_path / "sortie_?t?.png"))
    assert out.is_file()


def test_output_patterns_number_the_frames_as_input_patterns_do(tiny_options, tmp_path,
                                                                 capsys):
    """``-o out/%05d.png``: the syntax sequence inputs take; every frame numbered by it."""
    clip = tmp_path / "three.mp4"
    make_clip(clip, frames=3)
    (tmp_path / "out").mkdir()
    assert main(_args(tiny_options, str(clip), "-o", str(tmp_path / "out" / "%05d.png"))) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "00000.png", "00001.png", "00002.png"]
    frames = _frames(tmp_path / "out" / "%05d.png")  # read back by the same pattern
    assert frames.shape == (3, 64, 86, 3)
    assert main(_args(tiny_options, str(clip), "-o", str(tmp_path / "one_%d.png"))) == 0
    assert sorted(p.name for p in tmp_path.glob("one_*")) == ["one_0.png", "one_1.png",
                                                             "one_2.png"]


@pytest.mark.parametrize("name,message", [
    ("%d_%05d.png", "{out}: a sequence pattern needs exactly one %d, %05d or similar, in the "
                    "file name"),
    ("%05d.mp4", "{out}: a numbered pattern names image files, one per frame; give an image "
                 "extension (e.g. {folder}/%05d.png), or a file name without %"),
])
def test_bad_output_patterns_are_refused_before_any_work(tiny_options, tmp_path, capsys, name,
                                                         message):
    clip = tmp_path / "three.mp4"
    make_clip(clip, frames=3)
    out = tmp_path / name
    missing = str(tmp_path / "missing.safetensors")  # no model is loaded before the check
    args = _args(tiny_options, str(clip), "-o", str(out))
    args[args.index("--dit") + 1] = missing
    assert main(args) == 1
    assert capsys.readouterr().err == f"error: {message.format(out=out, folder=tmp_path)}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["three.mp4"]
