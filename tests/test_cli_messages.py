"""What the ``seedvr2`` command tells its user: grouped help, options named as flags (and as
keywords from Python), plain progress lines in logs, file problems before the models load,
and every missing model file in one quick error."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from seedvr2.cli import _PlainProgress, main
from seedvr2.loading import registry
from seedvr2.loading.weight_files import CheckpointError
from seedvr2.options import AREAS, OPTIONS, OptionError, resolve_options

from conftest import REPO


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_option_has_one_area():
    listed = [name for names in AREAS.values() for name in names]
    assert sorted(listed) == sorted(OPTIONS)  # each option once, none left out


def test_upscale_help_is_grouped_by_area_and_speaks_in_flags(capsys):
    text = _help(capsys, "upscale")
    headings = [line[:-1] for line in text.splitlines() if re.fullmatch(r"[a-z][a-zA-Z ]+:", line)]
    assert headings == ["options", *AREAS]
    sections = dict(zip(headings, re.split(r"^[a-z][a-zA-Z ]+:$", text, flags=re.M)[1:]))
    for area, names in AREAS.items():
        for name in names:
            assert re.search(rf"^  {OPTIONS[name].flag}\b", sections[area], re.M), (area, name)
    # Option names appear only as flags: no keyword spelling of any option with an underscore.
    assert not [name for name in OPTIONS if "_" in name and name in text]
    assert "--dit-offload-device" in sections["memory and VRAM"]  # named inside a help text
    models = " ".join(sections["models"].split())
    assert "seedvr2_ema_3b_fp16.safetensors" in models and "ema_vae_fp16.safetensors" in models
    assert "--model-dir, else $SEEDVR2_MODEL_DIR, else ~/.cache/seedvr2/models" in models
    # The ungrouped help was 201 lines; --scene-cuts and --dry-plan came later (4 lines),
    # --vae-fp16-accumulation and --vae-int8-cache (9 lines), --min-scene-length (5 lines),
    # --fit and --max-vram (5 lines).
    assert len(text.splitlines()) < 201 + 4 + 9 + 5 + 5


def test_top_level_help_has_no_markup(capsys):
    text = _help(capsys)
    assert "``" not in text and "python -m seedvr2" in " ".join(text.split())


# -- the caller's words -----------------------------------------------------------------------

def test_option_errors_name_keywords_from_python():
    with pytest.raises(OptionError, match=r"^batch_size = 8: must be 4n\+1"):
        resolve_options(batch_size=8)
    with pytest.raises(OptionError, match=r"^temporal_overlap = 5: must be smaller than batch_size"):
        resolve_options(temporal_overlap=5)
    assert "--" not in OPTIONS["blocks_to_swap"].help  # node tooltips and Python docs


def _tiny_args(tiny_options, *extra):
    return ["upscale", "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
            "--model-dir", str(tiny_options["model_dir"]), "--device", "cpu", "--dtype", "fp32",
            "--resolution", "32", "--quiet", *extra]


@pytest.fixture
def image(tmp_path):
    from PIL import Image

    path = tmp_path / "in.png"
    Image.fromarray(np.linspace(0, 255, 24 * 32 * 3).astype(np.uint8).reshape(24, 32, 3)).save(path)
    return path


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if the command gets as far as loading a model."""
    import seedvr2.api

    def refuse(*args, **kwargs):
        raise AssertionError("the models were loaded before the file problem was reported")
    monkeypatch.setattr(seedvr2.api, "load_models", refuse)


def test_cli_errors_name_flags(tiny_options, image, tmp_path, capsys, no_model_loading):
    assert main(_tiny_args(tiny_options, str(image), "--temporal-overlap", "5")) == 2
    assert "error: --temporal-overlap 5: must be smaller than --batch-size (5)" in capsys.readouterr().err
    taken = tmp_path / "taken.png"
    taken.write_bytes(b"keep")
    assert main(_tiny_args(tiny_options, str(image), "-o", str(taken))) == 1
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err
    assert taken.read_bytes() == b"keep"


def test_python_errors_name_keywords(tiny_options, image, tmp_path):
    import seedvr2
    from seedvr2.loading.text import load_text_embeddings

    taken = tmp_path / "taken.png"
    taken.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match=r"pass overwrite=True to replace it"):
        seedvr2.upscale_file(image, taken, **tiny_options)
    with pytest.raises(CheckpointError, match=r"or pass text_embeddings=PATH; found the bundled "
                                              r"official embeddings \(5120\)"):
        load_text_embeddings("auto", 64, tmp_path)


def test_cli_text_embeddings_error_names_the_flag(tiny_options, image, tmp_path, capsys):
    empty = tmp_path / "models"
    empty.mkdir()
    args = _tiny_args(tiny_options, str(image), "-o", str(tmp_path / "out.png"))
    args[args.index("--model-dir") + 1] = str(empty)  # the 64-wide embeddings are not here
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "or pass --text-embeddings PATH" in err and "text_embeddings=" not in err


# -- file problems come first -------------------------------------------------------------------

def test_unreadable_input_is_reported_before_models_load(tiny_options, tmp_path, capsys,
                                                         no_model_loading):
    missing = tmp_path / "missing.mp4"
    assert main(_tiny_args(tiny_options, str(missing), "-o", str(tmp_path / "o.mp4"))) == 1
    assert "missing.mp4: no such file or directory" in capsys.readouterr().err
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video" * 10)
    assert main(_tiny_args(tiny_options, str(garbage), "-o", str(tmp_path / "o.mp4"))) == 1
    assert "garbage.mp4" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.mp4"]


def test_unusable_output_is_reported_before_models_load(tiny_options, image, tmp_path, capsys,
                                                        no_model_loading):
    nowhere = tmp_path / "no_such_folder" / "out.png"
    assert main(_tiny_args(tiny_options, str(image), "-o", str(nowhere))) == 1
    assert f"output folder {nowhere.parent} does not exist" in capsys.readouterr().err
    assert main(_tiny_args(tiny_options, str(image), "-o", str(tmp_path / "out.webm"))) == 1
    assert "out.webm" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.png"]  # no temporary left


# -- progress in a log file ----------------------------------------------------------------------

def test_plain_progress_writes_one_line_per_phase_run():
    stream = io.StringIO()
    progress = _PlainProgress(stream)
    progress.start, progress.clock = 0.0, lambda: 30.0  # every line 30 s into the job
    # Two chunks of two batches each, as the pipeline reports them; frames after each decode.
    for chunk in (1, 2):
        for phase in ("encode", "dit", "decode"):
            for done in (2 * chunk - 1, 2 * chunk):
                progress(phase, done, 4)
                if phase == "decode":
                    progress("frames", 9 * done // 4, 9)
    progress.close()
    assert stream.getvalue().splitlines() == [
        "VAE encode: 2/4 batches, about 30 s left", "DiT: 2/4 batches, about 30 s left",
        "VAE decode: 2/4 batches, about 30 s left", "VAE encode: 4/4 batches", "DiT: 4/4 batches", "VAE decode: 4/4 batches",
        "frames: 9/9 frames"]


def test_log_file_gets_plain_lines_not_cursor_codes(tiny_options, image, tmp_path):
    log = tmp_path / "stderr.log"
    args = [a for a in _tiny_args(tiny_options, str(image), "-o", str(tmp_path / "out.png"),
                                  "--text-embeddings",
                                  str(tiny_options["model_dir"] / "text_64.safetensors"))
            if a != "--quiet"]
    with open(log, "w") as stderr:  # a file: not a terminal
        result = subprocess.run([sys.executable, "-m", "seedvr2", *args], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, cwd=REPO, timeout=300)
    text = log.read_text()
    assert result.returncode == 0, text
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    for line in ("VAE encode: 1/1 batch", "DiT: 1/1 batch", "VAE decode: 1/1 batch",
                 "frames: 1/1 frame"):
        assert lines.count(line) == 1, text


# -- missing models --------------------------------------------------------------------------------

def test_every_missing_model_in_one_quick_error(clip_path, tmp_path):
    """Offline: one error naming both default files (size, URL) and the folder, within
    seconds (huggingface_hub's own retries take about 25 s), and no lock files left."""
    models = tmp_path / "models"
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "seedvr2", "upscale", str(clip_path),
                             "-o", str(tmp_path / "out.png"), "--model-dir", str(models),
                             "--device", "cpu", "--quiet"], capture_output=True, text=True,
                            cwd=REPO, timeout=120,
                            env={**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9",
                                 "HF_HUB_OFFLINE": ""})
    seconds = time.perf_counter() - start
    assert result.returncode == 1
    # Python start-up and imports take 2-5 s on a loaded 2-core machine; the probe at most 3 s.
    assert seconds < 15, seconds
    err = result.stderr
    assert err.count("error:") == 1 and err.count("\n") == 1, err  # one line, no retry noise
    assert f"2 model files are missing from the model folder {models}" in err
    for name, size in (("seedvr2_ema_3b_fp16.safetensors", "about 6.8 GB"),
                       ("ema_vae_fp16.safetensors", "about 0.5 GB")):
        assert f"{name} ({size}) from {registry.download_url(name)}" in err
    assert "hub cannot be reached (127.0.0.1:9" in err and "--model-dir FOLDER" in err
    assert not list(tmp_path.rglob("*.lock"))


@pytest.fixture
def clip_path(image):
    return image


def test_all_files_are_checked_before_any_download(tmp_path, monkeypatch):
    fetched = []
    monkeypatch.setattr(registry, "hub_unreachable", lambda: None)
    monkeypatch.setattr(registry, "download", lambda name, folder: fetched.append(name))
    with pytest.raises(CheckpointError, match=r"VAE model 'no_such_vae.safetensors' not found"):
        registry.resolve_model_files([("seedvr2_ema_3b_fp16.safetensors", "dit"),
                                      ("no_such_vae.safetensors", "vae")], tmp_path,
                                     download_missing=True)
    assert fetched == []  # the DiT was not fetched for a job that cannot run

    def fake_download(name, folder):
        fetched.append(name)
        (folder / name).write_bytes(b"")
        return folder / name
    monkeypatch.setattr(registry, "download", fake_download)
    vae = tmp_path / "ema_vae_fp16.safetensors"
    vae.write_bytes(b"")
    paths = registry.resolve_model_files([("seedvr2_ema_7b_fp16.safetensors", "dit"),
                                          ("ema_vae_fp16.safetensors", "vae")], tmp_path,
                                         download_missing=True)
    assert fetched == ["seedvr2_ema_7b_fp16.safetensors"] and paths[1] == vae


def test_hub_probe_answers_quickly_when_nothing_listens(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for proxy in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    start = time.perf_counter()
    assert registry.hub_unreachable().startswith("127.0.0.1:9: ")
    assert time.perf_counter() - start < registry.HUB_PROBE_SECONDS
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert registry.hub_unreachable() == "HF_HUB_OFFLINE is set"


# -- the documentation agrees with the option table ---------------------------------------------

def _readme_value(text: str, opt):
    if opt.type is bool:
        return {"on": True, "off": False}.get(text, text)
    if opt.type in (int, float):
        try:
            return opt.type(text)
        except ValueError:
            return text
    return text


def _doc_pages() -> str:
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def test_readme_defaults_are_the_option_defaults():
    docs = _doc_pages()
    checked = 0
    # Option tables are those with a column headed "default" (other tables, such as the GPU
    # checks' sections, may name an option without giving its default); the option names are
    # in the first column.
    for table in re.findall(r"^\|[^\n]*\| default \|[^\n]*\n(?:\|[^\n]*\n)+", docs, re.M):
        header, _, *rows = table.splitlines()
        column = [c.strip() for c in header.strip("|").split("|")].index("default")
        for row in rows:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip("|"))]
            names = [n for n in re.findall(r"`(\w+)`", cells[0]) if n in OPTIONS]
            # Rows naming several options with different defaults give no single default to check.
            if not names or len({OPTIONS[n].default for n in names}) > 1:
                continue
            for name in names:
                assert _readme_value(cells[column], OPTIONS[name]) == OPTIONS[name].default, \
                    (name, cells[column])
                checked += 1
    assert checked >= 25
    # The command synopses show each option's flag with its default value.
    flags = {o.flag: o for o in OPTIONS.values()}
    shown = [(flag, value) for flag, value in re.findall(r"\[(--[a-z-]+) (\w+)\]", docs)
             if flag in flags]
    assert shown
    for flag, value in shown:
        assert _readme_value(value, flags[flag]) == flags[flag].default, (flag, value)
    assert "--batch-size 5" in (REPO / "README.md").read_text()


def test_hub_log_lines_appear_once():
    # The hub's loggers come from its own get_logger, which gives them a handler of their own.
    code = ("from huggingface_hub.utils import logging as hub_logging\n"
            "from seedvr2.cli import main\n"
            "main(['inspect', '/nonexistent.safetensors'])\n"
            "hub_logging.get_logger('huggingface_hub.utils._http').warning('Retrying in 1s')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.stderr.count("Retrying in 1s") == 1, result.stderr


def test_hub_probe_gives_up_on_a_silent_name_lookup(monkeypatch):
    import socket

    monkeypatch.setattr(registry, "HUB_PROBE_SECONDS", 0.2)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    for proxy in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    def silent_lookup(*args, **kwargs):  # a DNS server that never answers, then a timeout
        time.sleep(5)
        raise socket.timeout("timed out")

    monkeypatch.setattr(socket, "create_connection", silent_lookup)
    start = time.perf_counter()
    assert registry.hub_unreachable() == "hub.invalid:443: no answer within 0.2 s"
    assert time.perf_counter() - start < 2  # 0.2 s, and thread start-up on a busy machine
