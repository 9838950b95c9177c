"""Real-world media edge cases (issue 13): alpha in WebM, variable frame rate, streams that can't
be carried over, folder inputs, output path problems, image sequences, SIGTERM and messages
that name the real cause. Media are generated with PyAV; upscaling uses the tiny models on the
CPU."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
import warnings
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from seedvr2.cli import main
from seedvr2.io import MediaError, OutputSpec, open_media, open_writer

from conftest import REPO, make_clip

SAMPLE_RATE = 48000


def _cli_args(tiny_options, *extra, resolution=32):
    return ["upscale", "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
            "--model-dir", str(tiny_options["model_dir"]), "--device", "cpu", "--dtype", "fp32",
            "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
            "--resolution", str(resolution), "--batch-size", "5", "--quiet", *extra]


def _frame(i: int, width: int, height: int) -> np.ndarray:
    frame = np.zeros((height, width, 3), np.uint8)
    frame[..., 0] = (6 * i) % 256
    frame[..., 1] = np.linspace(0, 255, width, dtype=np.uint8)
    return frame


def _write_video(path: Path, times: list[Fraction], *, size=(32, 24), codec="libx264",
                 audio_codec: str | None = None, audio_seconds: float | None = None,
                 container_format: str | None = None, alpha: bool = False,
                 time_base=Fraction(1, 15360), gop: int | None = None):
    """A video whose frame ``i`` is shown at ``times[i]`` seconds (variable rate when the gaps
    differ), with an optional sine audio track."""
    width, height = size
    with av.open(str(path), "w", format=container_format) as out:
        video = out.add_stream(codec, rate=30)
        video.width, video.height = width, height
        video.pix_fmt = "yuva420p" if alpha else "yuv420p"
        video.time_base = video.codec_context.time_base = time_base
        if gop is not None:
            video.codec_context.gop_size = gop
            video.options = {"x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0"}
        audio = None
        if audio_codec is not None:
            audio = out.add_stream(audio_codec, rate=SAMPLE_RATE, layout="mono")
        for i, t in enumerate(times):
            rgb = _frame(i, width, height)
            if alpha:
                rgba = np.concatenate([rgb, np.zeros((height, width, 1), np.uint8)], axis=2)
                rgba[:, : width // 2, 3] = 255  # left half opaque, right half transparent
                picture = av.VideoFrame.from_ndarray(rgba, format="rgba")
            else:
                picture = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            picture.pts, picture.time_base = round(t / time_base), time_base
            out.mux(video.encode(picture))
        out.mux(video.encode(None))
        if audio is not None:
            total = int((audio_seconds or float(times[-1])) * SAMPLE_RATE)
            step = audio.codec_context.frame_size or 1024
            fmt = audio.codec_context.format.name
            wave = (0.3 * np.sin(2 * np.pi * 440 * np.arange(total) / SAMPLE_RATE))
            wave = wave.astype(np.float32) if "flt" in fmt else (wave * 32767).astype(np.int16)
            for start in range(0, total - step + 1, step):
                chunk = av.AudioFrame.from_ndarray(wave[None, start:start + step], format=fmt,
                                                   layout="mono")
                chunk.sample_rate, chunk.pts = SAMPLE_RATE, start
                chunk.time_base = Fraction(1, SAMPLE_RATE)
                out.mux(audio.encode(chunk))
            out.mux(audio.encode(None))


def _frame_times(path: Path) -> list[float]:
    """Every decoded frame's presentation time in seconds, from the first frame."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stamps = [frame.pts * stream.time_base for frame in container.decode(stream)]
    return [float(t - stamps[0]) for t in stamps]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# 0.4 s at 30 fps, then 0.6 s at 10 fps: 18 frames (short: the tiny models take ~1 s a frame).
VFR_TIMES = [Fraction(i, 30) for i in range(12)] + [Fraction(2, 5) + Fraction(i, 10)
                                                    for i in range(6)]


# ---------------------------------------------------------------------------------------------
# WebM alpha


def test_webm_vp9_alpha_reaches_a_png_sequence(tiny_options, tmp_path):
    """FFmpeg's own VP9 decoder drops the alpha plane WebM keeps beside each frame."""
    src = tmp_path / "alpha.webm"
    _write_video(src, [Fraction(i, 10) for i in range(5)], codec="libvpx-vp9",
                 size=(32, 24), alpha=True, time_base=Fraction(1, 1000))
    with open_media(src) as reader:
        assert reader.info.channels == 4
        first = next(iter(reader.frames()))
    assert first[:, :12, 3].min() >= 250 and first[:, 20:, 3].max() <= 5

    out = tmp_path / "out"
    assert main(_cli_args(tiny_options, str(src), "-o", f"{out}/")) == 0
    with open_media(out) as frames:
        assert frames.info.channels == 4 and frames.info.frame_count == 5
        alpha = next(iter(frames.frames()))[..., 3]
    width = alpha.shape[1]
    assert alpha[:, : width // 2 - 4].min() >= 250  # opaque half stays opaque
    assert alpha[:, width // 2 + 4:].max() <= 5  # transparent half stays transparent

    # The default output of a WebM is a WebM (VP9), which holds the alpha too.
    assert main(_cli_args(tiny_options, str(src))) == 0
    with open_media(tmp_path / "alpha_seedvr2_32p.webm") as video:
        assert video.info.channels == 4 and video.info.codec == "vp9"
        alpha = next(iter(video.frames()))[..., 3]
    assert alpha[:, : width // 2 - 4].min() >= 240 and alpha[:, width // 2 + 4:].max() <= 15


def test_alpha_into_h264_names_the_reason(tmp_path):
    src = tmp_path / "alpha.webm"
    _write_video(src, [Fraction(i, 10) for i in range(3)], codec="libvpx-vp9", alpha=True,
                 time_base=Fraction(1, 1000))
    with open_media(src) as reader:
        with pytest.warns(UserWarning, match="no alpha channel; alpha is dropped.*\\.webm"):
            open_writer(tmp_path / "o.mp4", like=reader.info).abort()
        with pytest.warns(UserWarning, match="MP4 can't store VP9's alpha"):
            open_writer(tmp_path / "o.mp4", OutputSpec(codec="vp9"), like=reader.info).abort()


# ---------------------------------------------------------------------------------------------
# Variable frame rate


def test_vfr_with_audio_round_trips_in_sync(tiny_options, tmp_path):
    """Every output frame within one source frame interval of its source time; audio kept."""
    src = tmp_path / "vfr.mp4"
    _write_video(src, VFR_TIMES, audio_codec="aac", audio_seconds=1.0)
    source_times = _frame_times(src)
    assert len(source_times) == len(VFR_TIMES)

    out = tmp_path / "out.mp4"
    assert main(_cli_args(tiny_options, str(src), "-o", str(out))) == 0
    out_times = _frame_times(out)
    assert len(out_times) == len(VFR_TIMES)
    intervals = np.diff(source_times + [source_times[-1] + 0.1])
    errors = np.abs(np.array(out_times) - np.array(source_times))
    assert (errors <= intervals).all(), errors.max()
    assert abs(out_times[12] - 0.4) < 1e-3  # the first 10 fps frame stays at 0.4 s
    with av.open(str(out)) as container:
        assert len(container.streams.audio) == 1
        audio = container.streams.audio[0]
        assert abs(float(audio.duration * audio.time_base) - 1.0) < 0.05


def _end_edit_list_at_last_frame(path: Path, last_frame_seconds: float):
    """Shorten the MP4 edit list to end at ``last_frame_seconds``, as FFmpeg's muxer does (at
    the last frame's start) for a variable-rate stream whose last frame has no duration: the
    packets stay, yet decoders drop the frames -- the container's frame count is too high."""
    data = bytearray(path.read_bytes())
    mvhd = data.index(b"mvhd")
    assert data[mvhd + 4] == 0  # version 0: 32-bit times
    timescale = struct.unpack(">I", data[mvhd + 16:mvhd + 20])[0]
    elst = data.index(b"elst")
    assert data[elst + 4] == 0 and struct.unpack(">I", data[elst + 8:elst + 12])[0] == 1
    data[elst + 12:elst + 16] = struct.pack(">I", round(last_frame_seconds * timescale))
    path.write_bytes(bytes(data))


def test_vfr_clip_whose_container_count_is_one_too_many(tiny_options, tmp_path):
    """30 fps, then 10 fps, with one packet more than decodable frames (as FFmpeg's concat
    filter and -fps_mode vfr make it): no 'the input ended after 17 frames; 18 were
    expected'."""
    src = tmp_path / "concat.mp4"
    _write_video(src, VFR_TIMES, time_base=Fraction(1, 1_000_000))
    _end_edit_list_at_last_frame(src, float(VFR_TIMES[-1]))
    decodable = len(_frame_times(src))
    with av.open(str(src)) as container:
        assert container.streams.video[0].frames == decodable + 1  # the trap is set
    with open_media(src) as reader:
        assert reader.info.frame_count == decodable
        assert sum(1 for _ in reader.frames()) == decodable

    out = tmp_path / "out.mp4"
    assert main(_cli_args(tiny_options, str(src), "-o", str(out))) == 0
    assert len(_frame_times(out)) == decodable


def test_constant_rate_mp4_trimmed_by_its_edit_list(tiny_options, tmp_path):
    """An editor's trim without re-encoding: the MP4 keeps every packet and an edit list
    shows fewer frames. The stored count is not what decodes."""
    src = tmp_path / "trimmed.mp4"
    _write_video(src, [Fraction(i, 30) for i in range(12)], time_base=Fraction(1, 1_000_000))
    _end_edit_list_at_last_frame(src, 9 / 30)  # frames 9, 10, 11 hidden
    decodable = len(_frame_times(src))
    with av.open(str(src)) as container:
        assert container.streams.video[0].frames > decodable
    with open_media(src) as reader:
        assert reader.info.frame_count == decodable
    out = tmp_path / "out.mp4"
    assert main(_cli_args(tiny_options, str(src), "-o", str(out))) == 0
    assert len(_frame_times(out)) == decodable


def test_vfr_decode_pass_runs_once_per_unchanged_file(tmp_path, monkeypatch):
    """The command opens its input to check it before the models load, then for the work."""
    from seedvr2.io import reader as reader_module

    src = tmp_path / "vfr.mp4"
    _write_video(src, VFR_TIMES)
    decodes = []
    original = reader_module.VideoReader._decode

    def counting(self, container):
        decodes.append(self.path)
        return original(self, container)
    monkeypatch.setattr(reader_module.VideoReader, "_decode", counting)
    open_media(src).close()
    first = len(decodes)  # the first frame at open, then the counting pass
    open_media(src).close()
    assert len(decodes) - first == 1  # only the first frame
    stat = src.stat()
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # "changed"
    with open_media(src) as reader:
        assert len(decodes) - first == 1 + first
        assert reader.info.frame_count == len(VFR_TIMES)


def test_vfr_frames_from_a_start_frame_seek_exactly(tmp_path):
    """Known frame times let a variable-rate video seek (resume, ranks) instead of decoding
    from the start, and frame ``i`` is still the ``i``-th frame of a full decode."""
    src = tmp_path / "vfr.mp4"
    _write_video(src, VFR_TIMES, gop=4)
    with open_media(src) as reader:
        assert reader.info.frame_times is not None
        assert reader._seekable
        everything = list(reader.frames())
        for start in (1, 5, 12, 13, 16, 17):
            part = list(reader.frames(start=start))
            assert len(part) == len(everything) - start
            assert all(np.array_equal(a, b) for a, b in zip(part, everything[start:]))
        assert list(reader.frames(start=len(everything))) == []


# ---------------------------------------------------------------------------------------------
# Streams that are not carried over


def _with_extra_streams(path: Path, tmp_path: Path):
    """MKV: video, a second video stream, mono AAC and a SubRip subtitle."""
    srt = tmp_path / "subs.srt"
    srt.write_text("1\n00:00:00,100 --> 00:00:00,300\nHello\n\n")
    with av.open(str(srt)) as subtitles, av.open(str(path), "w") as out:
        streams = []
        for _ in range(2):
            video = out.add_stream("libx264", rate=10)
            video.width, video.height, video.pix_fmt = 32, 24, "yuv420p"
            streams.append(video)
        audio = out.add_stream("aac", rate=SAMPLE_RATE, layout="mono")
        subtitle = out.add_stream_from_template(subtitles.streams[0])
        for packet in subtitles.demux():
            if packet.size:
                packet.stream = subtitle
                out.mux(packet)
        for i in range(5):
            for video in streams:
                picture = av.VideoFrame.from_ndarray(_frame(i, 32, 24), format="rgb24")
                picture.pts, picture.time_base = i, Fraction(1, 10)
                out.mux(video.encode(picture))
        for start in range(0, SAMPLE_RATE // 2, 1024):
            chunk = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp",
                                               layout="mono")
            chunk.sample_rate, chunk.pts = SAMPLE_RATE, start
            chunk.time_base = Fraction(1, SAMPLE_RATE)
            out.mux(audio.encode(chunk))
        for stream in (*streams, audio):
            out.mux(stream.encode(None))


def _copy(src: Path, dst: Path):
    with open_media(src) as reader:
        with open_writer(dst, OutputSpec(audio_from=reader.info), like=reader.info) as writer:
            writer.write_many(reader.frames())


def test_subtitles_copied_where_the_container_holds_them(tmp_path):
    src = tmp_path / "extra.mkv"
    _with_extra_streams(src, tmp_path)
    out = tmp_path / "out.mkv"
    with pytest.warns(UserWarning) as caught:
        _copy(src, out)
    with av.open(str(out)) as container:
        assert [s.type for s in container.streams] == ["video", "audio", "subtitle"]
        packets = [p for p in container.demux(container.streams.subtitles[0]) if p.size]
        assert bytes(packets[0]).strip() == b"Hello"
    messages = [str(w.message) for w in caught if "not carried over" in str(w.message)]
    assert len(messages) == 1
    assert "video stream #1" in messages[0] and "subtitle stream" not in messages[0]


def test_everything_left_out_is_named_in_one_warning(tmp_path):
    src = tmp_path / "extra.mkv"
    _with_extra_streams(src, tmp_path)
    with pytest.warns(UserWarning) as caught:
        _copy(src, tmp_path / "out.mp4")  # MP4 holds no SubRip
    messages = [str(w.message) for w in caught if "not carried over" in str(w.message)]
    assert len(messages) == 1
    assert "video stream #1" in messages[0] and "subtitle stream #3" in messages[0]
    assert ".mkv holds it" in messages[0]

    with pytest.warns(UserWarning) as caught:
        _copy(src, tmp_path / "frame.png")  # images hold neither audio nor subtitles
    messages = [str(w.message) for w in caught if "not carried over" in str(w.message)]
    assert len(messages) == 1
    assert "audio" in messages[0] and "subtitle stream #3" in messages[0]


def test_cli_names_what_is_left_out_once(tiny_options, tmp_path, capsys):
    """The files are checked before the models load and opened again for the work: the
    warning still appears once, as one plain line."""
    src = tmp_path / "extra.mkv"
    _with_extra_streams(src, tmp_path)
    assert main(_cli_args(tiny_options, str(src), "-o", str(tmp_path / "out.mp4"))) == 0
    err = capsys.readouterr().err
    assert err.count("not carried over") == 1
    assert err.startswith("warning: ") and "UserWarning" not in err


# ---------------------------------------------------------------------------------------------
# Messages that name the real cause


def test_opus_into_mov_names_codec_and_a_container_that_holds_it(tmp_path):
    src = tmp_path / "opus.webm"
    _write_video(src, [Fraction(i, 10) for i in range(3)], codec="libvpx-vp9",
                 audio_codec="libopus", time_base=Fraction(1, 1000))
    with open_media(src) as reader:
        with pytest.raises(MediaError, match=r"\.mov files can't hold the Opus audio.*"
                                             r"write \.mp4 or \.mkv"):
            open_writer(tmp_path / "out.mov", OutputSpec(audio_from=reader.info), like=reader.info)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opus.webm"]


def test_text_file_named_png_is_not_an_image(tmp_path):
    fake = tmp_path / "photo.png"
    fake.write_text("<html>404 not found</html>\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FFmpeg decoding complaint first
        with pytest.raises(MediaError, match="photo.png: not an image") as raised:
            open_media(fake)
    assert "zero frames" not in str(raised.value)


# ---------------------------------------------------------------------------------------------
# Folder input and output paths


def _gif(path: Path, frames: int = 3):
    with av.open(str(path), "w") as out:
        stream = out.add_stream("gif", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "rgb8"
        for i in range(frames):
            picture = av.VideoFrame.from_ndarray(_frame(i, 32, 24), format="rgb24")
            picture.pts, picture.time_base = i, Fraction(1, 10)
            out.mux(stream.encode(picture))
        out.mux(stream.encode(None))


def test_folder_outputs_map_like_single_files_and_one_bad_file_fails_alone(
        tiny_options, tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    _gif(src / "a.gif")
    _write_video(src / "b.avi", [Fraction(i, 10) for i in range(3)], codec="mpeg4")
    _write_video(src / "c.webm", [Fraction(i, 10) for i in range(3)], codec="libvpx-vp9",
                 time_base=Fraction(1, 1000))
    (src / "d.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100)  # broken
    out = tmp_path / "out"
    assert main(_cli_args(tiny_options, str(src), "-o", str(out))) == 1
    err = capsys.readouterr().err
    assert "d.mp4" in err and "1 of 4 inputs failed" in err
    assert sorted(p.name for p in out.iterdir()) == ["a.mp4", "b.mp4", "c.webm"]
    for name in ("a.mp4", "b.mp4", "c.webm"):
        with open_media(out / name) as reader:
            assert reader.info.frame_count == 3


def test_folder_output_problems_are_clear_and_leave_nothing(tiny_options, tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    (src / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100)

    taken = tmp_path / "taken.mp4"
    taken.write_bytes(b"precious")
    assert main(_cli_args(tiny_options, str(src), "-o", str(taken))) == 2
    err = capsys.readouterr().err
    assert "taken.mp4 is a file" in err and "Traceback" not in err
    assert taken.read_bytes() == b"precious"

    assert main(_cli_args(tiny_options, str(src), "-o", "/proc/seedvr2-no-such/out")) == 1
    err = capsys.readouterr().err
    assert "cannot create the output folder /proc/seedvr2-no-such/out" in err

    # Every input failing leaves no (empty) output folder behind, nor the parents it made.
    assert main(_cli_args(tiny_options, str(src))) == 1
    assert main(_cli_args(tiny_options, str(src), "-o", str(tmp_path / "new" / "out"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "taken.mp4"]


# ---------------------------------------------------------------------------------------------
# Image sequences


def _png_sequence(folder: Path, count: int = 5):
    from PIL import Image

    folder.mkdir()
    for i in range(count):
        Image.fromarray(_frame(i, 32, 24)).save(folder / f"{i:05d}.png")


def test_every_numbered_output_name_is_checked_up_front(tmp_path):
    _png_sequence(tmp_path / "frames")
    (tmp_path / "o_00003.png").write_bytes(b"precious")
    with open_media(tmp_path / "frames" / "%05d.png") as reader:
        with pytest.raises(FileExistsError, match="o_00003.png"):
            open_writer(tmp_path / "o.png", like=reader.info)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames", "o_00003.png"]


def test_pattern_input_default_output_and_fps(tiny_options, tmp_path, capsys):
    _png_sequence(tmp_path / "frames")
    pattern = str(tmp_path / "frames" / "%05d.png")
    assert main(_cli_args(tiny_options, pattern)) == 0
    out = tmp_path / "frames_seedvr2_32p"
    assert sorted(p.name for p in out.iterdir()) == [f"{i:05d}.png" for i in range(5)]
    assert not any("%" in p.name for p in (tmp_path / "frames").iterdir())

    video = tmp_path / "seq.mp4"
    assert main(_cli_args(tiny_options, pattern, "-o", str(video))) == 1
    assert "give one, e.g. --fps 24" in capsys.readouterr().err
    assert not video.exists() and _leftovers(tmp_path) == []
    assert main(_cli_args(tiny_options, pattern, "-o", str(video), "--fps", "12")) == 0
    with av.open(str(video)) as container:
        assert container.streams.video[0].average_rate == 12
        assert container.streams.video[0].frames == 5


def test_fps_does_not_retime_a_video(tmp_path):
    """A video keeps its own rate (its sound would drift otherwise); --fps says it is ignored."""
    from seedvr2.io.files import FileOutput

    src = tmp_path / "clip.mp4"
    _write_video(src, [Fraction(i, 10) for i in range(3)])
    with open_media(src) as reader:
        with pytest.warns(UserWarning, match="fps = '24' ignored.*keeps its own rate"):
            writer = FileOutput(tmp_path / "out.mp4", (24, 32), 8, fps="24").open(reader.info)
        assert writer.fps == 10
        writer.abort()


def test_bad_fps_is_refused(tiny_options, tmp_path, capsys):
    assert main(_cli_args(tiny_options, str(tmp_path / "x.png"), "--fps", "fast")) == 2
    assert "--fps fast: expected auto, or a positive rate" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# SIGTERM


def test_sigterm_cleans_up_like_ctrl_c(tiny_options, tmp_path):
    src = tmp_path / "clip.mp4"
    make_clip(src, frames=60)
    out = tmp_path / "out.mp4"
    command = [sys.executable, "-m", "seedvr2",
               *_cli_args(tiny_options, str(src), "-o", str(out), resolution=64)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _leftovers(tmp_path) and time.monotonic() < deadline \
                and process.poll() is None:
            time.sleep(0.05)
        assert _leftovers(tmp_path), "the run never started writing"
        time.sleep(0.5)  # mid-run: the writer is open and frames are being processed
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "Traceback" not in err
    # Stopped before its first piece closed (a minute of work): nothing to resume from.
    assert err.rstrip().endswith("terminated (SIGTERM); the output was not written and "
                                 "nothing was kept")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]


def test_sigterm_after_a_closed_piece_says_where_it_is_kept(tiny_options, tmp_path):
    """A part closes at every chunk end here: stopped after one, the message names the resume
    folder, and the same command finishes the job from it."""
    src = tmp_path / "clip.mp4"
    make_clip(src, frames=30)
    out = tmp_path / "out.mp4"
    journal = tmp_path / ".out.mp4.seedvr2-resume" / "journal.json"
    command = [sys.executable, "-m", "seedvr2",
               *_cli_args(tiny_options, str(src), "-o", str(out), resolution=64)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "SEEDVR2_CHECKPOINT_SECONDS": "0"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not journal.is_file() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert journal.is_file(), "no piece was closed"
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert err.rstrip().endswith(
        f"terminated (SIGTERM); the output was not written; its finished pieces are kept in "
        f"{journal.parent}: run the same command again to continue")
    assert not out.exists()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.is_file() and not journal.parent.exists()
