"""Resume: a job SIGKILLed at any point, run again, computes only the missing batches and
gives the frames of an uninterrupted run; anything different starts fresh and says why."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, make_clip

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# 23 frames in batches of 5 overlapping by 1: batches start at 0, 4, 8, 12, 16, 20; with
# segments of at least 8 frames they make three segments of two batches each.
SEGMENT_ENV = {"SEEDVR2_SEGMENT_FRAMES": "8"}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("resume") / "clip.mp4"
    make_clip(path, frames=23)
    return path


def _command(tiny_options, src, dst, *extra, env=None, launcher=()) -> tuple[list, dict]:
    cmd = [sys.executable, "-m", *launcher, "seedvr2", "upscale", str(src), "-o", str(dst),
           "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
           "--model-dir", str(tiny_options["model_dir"]), "--dtype", "fp32", "--device", "cpu",
           "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
           "--resolution", "32", "--batch-size", "5", "--temporal-overlap", "1", *extra]
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                 **SEGMENT_ENV, **(env or {})}


def _cli(tiny_options, src, dst, *extra, env=None, launcher=()):
    cmd, environment = _command(tiny_options, src, dst, *extra, env=env, launcher=launcher)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=environment,
                          timeout=300)


def _frames(path):
    from seedvr2.io import open_media

    with open_media(path) as media:
        return np.stack(list(media.frames()))


def _reused(result) -> int:
    found = re.search(r"(\d+) of 6 batches reused", result.stdout + result.stderr)
    assert found, result.stdout[-2000:] + result.stderr[-2000:]
    return int(found.group(1))


@pytest.fixture(scope="module")
def uninterrupted(clip, tiny_options, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "up.mp4"
    result = _cli(tiny_options, clip, out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _reused(result) == 0
    return out


@pytest.mark.parametrize("kill,reused", [
    ({"SEEDVR2_KILL_AT": "encode:2"}, 0),  # mid-encode of the first segment
    ({"SEEDVR2_KILL_AT": "dit:4"}, 2),  # mid-DiT of the second segment
    ({"SEEDVR2_KILL_AT": "write:2"}, 2),  # the second segment half written
    ({"SEEDVR2_KILL_AT": "segment:2"}, 2),  # closed, but not yet in the journal
    ({"SEEDVR2_KILL_AT": "journal:2"}, 4),  # in the journal
    ({"SEEDVR2_KILL_IN_ASSEMBLY": "2"}, 6),  # every batch done, the final file half made
])
def test_killed_job_reruns_only_missing_batches(clip, tiny_options, tmp_path, uninterrupted,
                                                kill, reused):
    out = tmp_path / "up.mp4"
    killed = _cli(tiny_options, clip, out, env=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()
    again = _cli(tiny_options, clip, out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _reused(again) == reused
    assert np.array_equal(_frames(out), _frames(uninterrupted))
    assert out.read_bytes() == uninterrupted.read_bytes()  # the same stream, audio included
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up.mp4"]  # nothing left over


def test_different_job_or_no_resume_starts_fresh(clip, tiny_options, tmp_path, uninterrupted):
    out = tmp_path / "up.mp4"
    killed = _cli(tiny_options, clip, out, env={"SEEDVR2_KILL_AT": "journal:2"})
    assert killed.returncode == -signal.SIGKILL
    other_seed = _cli(tiny_options, clip, out, "--seed", "7",
                      env={"SEEDVR2_KILL_AT": "journal:1"})
    assert other_seed.returncode == -signal.SIGKILL
    assert "not resuming, starting fresh: options seed (42 -> 7) changed" in other_seed.stderr
    fresh = _cli(tiny_options, clip, out, "--no-resume")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert "resume is off: the kept segments are discarded" in fresh.stderr
    assert _reused(fresh) == 0
    assert out.read_bytes() == uninterrupted.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up.mp4"]


@pytest.mark.parametrize("first,rerun", [
    ([], ["--devices", "cpu,cpu"]),
    ([], []),
    (["--sequence-parallel", "2"], ["--devices", "cpu,cpu", "--sequence-parallel", "2"]),
], ids=["two-ranks", "one", "sequence-parallel"])
def test_killed_multi_process_job_resumes(clip, tiny_options, tmp_path, uninterrupted, first,
                                          rerun):
    """The writer of a two-rank job is SIGKILLed once its journal names the second segment:
    the job fails naming it, and the complete segments stay. The same command again — with
    two ranks, with one process, or with both ranks sharing each batch (sequence parallel) —
    computes only the last segment's batches and gives the file of an uninterrupted run."""
    out = tmp_path / "up.mp4"
    killed = _cli(tiny_options, clip, out, "--devices", "cpu,cpu", "--dist-timeout", "20",
                  *first, env={"SEEDVR2_KILL_AT": "journal:2"})
    assert killed.returncode != 0
    assert "rank 0 exited with code -9" in killed.stderr, killed.stderr[-2000:]
    assert not out.exists()
    again = _cli(tiny_options, clip, out, *rerun)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _reused(again) == 4
    assert np.array_equal(_frames(out), _frames(uninterrupted))
    assert out.read_bytes() == uninterrupted.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up.mp4"]


def test_torchrun_restart_resumes(clip, tiny_options, tmp_path, uninterrupted):
    """Under torchrun with --max-restarts, the writer dies (once) in its third batch; torchrun
    restarts both workers, which continue from the complete segment: the same file."""
    out = tmp_path / "up.mp4"
    result = _cli(tiny_options, clip, out, "--dist-timeout", "20",
                  launcher=("torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "--max-restarts", "1", "-m"),
                  env={"SEEDVR2_FAULT": "0:after_batches=3",
                       "SEEDVR2_FAULT_MARK": str(tmp_path.parent / f"{tmp_path.name}-fault")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path.parent / f"{tmp_path.name}-fault").exists()  # the fault did fire
    assert _reused(result) == 2
    assert np.array_equal(_frames(out), _frames(uninterrupted))
    assert out.read_bytes() == uninterrupted.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up.mp4"]


def test_writer_cut_off_from_the_store_keeps_only_closed_pieces(clip, tiny_options, tmp_path):
    """The job's store stops answering while the writer has half of its second segment
    written (the launcher, which hosts the store, is frozen: SIGSTOP; to the ranks as silent
    as a cut cable). Both ranks end themselves within dist_timeout, status 3, naming the
    store; the journal names the closed segment only, and the half-written one is a hidden
    temporary, never a finished-looking file: what the next run resumes from (as after a
    kill: test_killed_job_reruns_only_missing_batches)."""
    out, mark, log = tmp_path / "up.mp4", tmp_path.parent / f"{tmp_path.name}-cut", \
        tmp_path.parent / f"{tmp_path.name}.err"
    # Segments of two one-batch chunks: the fault stops the writer once it holds its third
    # batch; it writes it into the second segment, then needs the store for the fourth.
    cmd, env = _command(tiny_options, clip, out, "--devices", "cpu,cpu", "--dist-timeout", "3",
                        env={"SEEDVR2_FAULT": "0:cut_off_after_batches=2",
                             "SEEDVR2_FAULT_MARK": str(mark)})
    with open(log, "w") as err:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                    stderr=err)
    lost = "lost the job: the job's store (127.0.0.1:"
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), log.read_text()[-3000:]
        launcher.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        Path(f"{mark}.cut").touch()
        while log.read_text().count(lost) < 2 and time.monotonic() - frozen < 3 + 10:
            time.sleep(0.05)
        ended = time.monotonic() - frozen
    finally:
        launcher.send_signal(signal.SIGCONT)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:  # its ranks end by themselves once its store is gone
            launcher.kill()
            launcher.wait()
            raise
    assert log.read_text().count(lost) == 2, log.read_text()[-3000:]
    assert ended < 3 + 10, f"the ranks ended {ended:.1f}s after the store went silent"
    assert launcher.returncode != 0
    assert "rank 0 exited with code 3" in log.read_text(), log.read_text()[-3000:]
    folder = tmp_path / ".up.mp4.seedvr2-resume"
    journal = json.loads((folder / "journal.json").read_text())
    assert [piece["name"] for piece in journal["pieces"]] == ["seg-00000.mp4"]
    left = sorted(p.name for p in folder.iterdir())
    assert "seg-00001.mp4" not in left and any(n.startswith(".seg-00001.") for n in left), left
    assert not out.exists()


def _vfr_with_subtitles(path, tmp_path):
    """MKV: 18 frames at 30 fps then 10 fps, a second of AAC, two SubRip subtitles."""
    import av
    from test_media_edge import VFR_TIMES, _write_video

    plain = tmp_path / "plain.mkv"
    _write_video(plain, VFR_TIMES, audio_codec="aac", audio_seconds=1.0,
                 container_format="matroska")
    srt = tmp_path / "subs.srt"
    srt.write_text("1\n00:00:00,100 --> 00:00:00,300\nHello\n\n"
                   "2\n00:00:00,700 --> 00:00:00,900\nLater\n\n")
    with av.open(str(plain)) as source, av.open(str(srt)) as subs, \
            av.open(str(path), "w") as out:
        streams = {s.index: out.add_stream_from_template(s) for s in source.streams}
        subtitle = out.add_stream_from_template(subs.streams[0])
        for packet in subs.demux():
            if packet.size:
                packet.stream = subtitle
                out.mux(packet)
        for packet in source.demux():
            if packet.size:
                packet.stream = streams[packet.stream.index]
                out.mux(packet)


def test_variable_rate_video_with_subtitles_resumes(tiny_options, tmp_path):
    """A variable-rate source resumes too: each segment is written at its frames' own times
    and shifted by its first frame's time when joined; audio and subtitles are copied in at
    assembly. Frames, frame times and streams equal the uninterrupted run's."""
    import av
    from test_media_edge import _frame_times

    src = tmp_path / "vfr.mkv"
    _vfr_with_subtitles(src, tmp_path)
    whole = _cli(tiny_options, src, tmp_path / "whole.mkv")
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = _cli(tiny_options, src, tmp_path / "up.mkv", env={"SEEDVR2_KILL_AT": "journal:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    again = _cli(tiny_options, src, tmp_path / "up.mkv")
    assert again.returncode == 0, again.stderr[-2000:]
    found = re.search(r"(\d+) of (\d+) batches reused", again.stdout)
    assert found and 0 < int(found.group(1)) < int(found.group(2)), again.stdout[-2000:]
    resumed, uninterrupted = tmp_path / "up.mkv", tmp_path / "whole.mkv"
    assert np.array_equal(_frames(resumed), _frames(uninterrupted))
    # Matroska stores milliseconds: the times agree to the millisecond.
    assert np.allclose(_frame_times(resumed), _frame_times(uninterrupted), atol=1e-3)
    assert abs(_frame_times(resumed)[12] - 0.4) < 1e-3  # the first 10 fps frame
    def carried(path):  # (type, time, bytes) of every audio and subtitle packet
        with av.open(str(path)) as container:
            assert [s.type for s in container.streams] == ["video", "audio", "subtitle"]
            return [(p.stream.type, p.pts, bytes(p)) for p in container.demux(
                container.streams.audio[0], container.streams.subtitles[0]) if p.size]
    packets = carried(resumed)
    assert packets == carried(uninterrupted)
    assert [data.strip() for kind, _, data in packets if kind == "subtitle"] == [
        b"Hello", b"Later"]
    assert sum(kind == "audio" for kind, _, _ in packets) >= 45  # a second of 1024-sample AAC
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "plain.mkv", "subs.srt", "up.mkv", "vfr.mkv", "whole.mkv"]


def test_image_sequence_output_resumes(clip, tiny_options, tmp_path):
    whole = _cli(tiny_options, clip, f"{tmp_path}/whole/")
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = _cli(tiny_options, clip, f"{tmp_path}/frames/", env={"SEEDVR2_KILL_AT": "write:3"})
    assert killed.returncode == -signal.SIGKILL
    again = _cli(tiny_options, clip, f"{tmp_path}/frames/")
    assert again.returncode == 0, again.stderr[-2000:]
    assert _reused(again) == 4
    resumed = _frames(f"{tmp_path}/frames/%05d.png")
    assert resumed.shape == (23, 32, 42, 3)
    assert np.array_equal(resumed, _frames(f"{tmp_path}/whole/%05d.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames", "whole"]


def test_upscale_video_file_node_resumes_when_queued_again_after_cancel(
        clip, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """ComfyUI's Upscale Video File: Cancel mid-job keeps the complete segments; the same
    prompt queued again writes the same output name and continues from them."""
    import logging

    from seedvr2.workflow import nodes as defs
    from seedvr2.workflow.errors import WorkflowInterrupted
    from seedvr2.workflow.host import HeadlessHost

    monkeypatch.setenv("SEEDVR2_SEGMENT_FRAMES", "8")
    nodes = {n.id: n for n in defs.build_nodes()}

    def loaders(host):
        def defaults(kind):
            return {s.input: s.node_input().default for s in defs.LOADER_SETTINGS[kind]
                    if not s.node_input().optional}
        dit = nodes["SeedVR2LoadDiTModel"].run(host, model="dit3b_tiny.safetensors",
                                               **{**defaults("dit"), "device": "cpu",
                                                  "dtype": "fp32"}).outputs[0]
        vae = nodes["SeedVR2LoadVAEModel"].run(host, model="vae_tiny.safetensors",
                                               **{**defaults("vae"), "device": "cpu",
                                                  "dtype": "fp32"}).outputs[0]
        return dit, vae

    node = nodes["SeedVR2UpscaleVideoFile"]
    inputs = {i.name: i.default for i in node.inputs if i.is_widget}
    inputs.update(resolution=32, batch_size=5, temporal_overlap=1, filename_prefix="up",
                  video_path=clip.name, codec="h264")

    def run(host):
        return node.run(host, **dict(zip(("dit", "vae"), loaders(host))), **inputs)

    whole = run(HeadlessHost(model_dir=tiny_model_dir, input_dir=clip.parent,
                             output_dir=tmp_path / "whole", quiet=True)).outputs[0]

    class CancelAfterFrames(HeadlessHost):
        def progress(self, value, total):
            if value >= 12:  # 12 of 18 phase steps: four batches done, two segments closed
                self.stop.set()

    out_dir = tmp_path / "out"
    with pytest.raises(WorkflowInterrupted):
        run(CancelAfterFrames(model_dir=tiny_model_dir, input_dir=clip.parent, output_dir=out_dir,
                              quiet=True))
    assert [p.name for p in out_dir.iterdir()] == [".up_00001_.mp4.seedvr2-resume"]
    caplog.set_level(logging.INFO, logger="seedvr2")
    again = run(HeadlessHost(model_dir=tiny_model_dir, input_dir=clip.parent, output_dir=out_dir,
                             quiet=True))
    resumed = again.outputs[0]
    assert resumed.endswith("up_00001_.mp4")
    assert "resuming: 4 of 6 batches are kept" in caplog.text, caplog.text
    assert open(resumed, "rb").read() == open(whole, "rb").read()
    assert sorted(p.name for p in out_dir.iterdir()) == ["up_00001_.mp4"]
