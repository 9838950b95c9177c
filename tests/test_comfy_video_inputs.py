"""ComfyUI VIDEO values that are not a file on disk, as the pack's ComfyHost takes them: an
in-memory container (VideoFromFile over a BytesIO) is copied to ComfyUI's temp folder and
streamed, a concatenation (VideoFromList) is written there part by part, and what only frames
can show is taken into memory only after its size is logged and checked against the RAM.

The comfy_api classes are stand-ins shaped like today's core (comfy_api/latest/_input_impl/
video_types.py: VideoFromFile(file, start_time=, duration=, crop=), VideoFromList(videos,
complete_audio=), VideoFromComponents(components)); their get_components fails the test, so
"never in memory" is checked, not assumed."""

from __future__ import annotations

import io
import logging
import tracemalloc
import types
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, make_clip

from seedvr2.io import open_media


def _probe(file):
    """(width, height, frames) as core's VideoFromFile reads them: PyAV's errors as they come,
    ValueError for a container without video."""
    import av

    if isinstance(file, io.BytesIO):
        file.seek(0)
    with av.open(file) as container:
        if not container.streams.video:
            raise ValueError(f"No video stream found in file '{file}'")
        stream = container.streams.video[0]
        return stream.width, stream.height, stream.frames


class VideoFromFile:
    def __init__(self, file, *, start_time=0, duration=0, crop=None):
        self.file, self.start, self.duration, self.crop = file, start_time, duration, crop

    def get_stream_source(self):
        if isinstance(self.file, io.BytesIO):
            self.file.seek(0)
        return self.file

    def get_active_trim_window(self):
        return float(self.start), float(self.duration)

    def get_dimensions(self):
        return tuple(self.crop[2:]) if self.crop is not None else _probe(self.file)[:2]

    def get_frame_count(self):
        return _probe(self.file)[2]

    def as_cropped(self, x=0, y=0, width=0, height=0):
        return VideoFromFile(self.file, start_time=self.start, duration=self.duration,
                             crop=(x, y, width, height))

    def get_components(self):
        raise AssertionError("the frames were taken into memory")


class VideoFromComponents:
    def __init__(self, components):
        self.components = components

    def get_components(self):
        return self.components

    def get_dimensions(self):
        return self.components.images.shape[2], self.components.images.shape[1]

    def get_frame_count(self):
        return self.components.images.shape[0]


class VideoFromList:
    """Core's concatenation: parts flattened, every part a VideoFromFile (core saves any other
    part into a BytesIO), a soundtrack for all of it or None; its get_components would hold
    every frame."""

    def __init__(self, videos, complete_audio=None):
        self.videos = [p for v in videos for p in (v.videos if isinstance(v, VideoFromList)
                                                   else [v])]
        self.complete_audio = complete_audio

    def get_dimensions(self):
        return self.videos[0].get_dimensions()

    def get_frame_count(self):
        return sum(v.get_frame_count() for v in self.videos)

    def get_components(self):
        raise AssertionError("the frames were taken into memory")


@pytest.fixture
def comfy_host(tmp_path, monkeypatch):
    """The pack's ComfyHost (imported as ComfyUI imports the pack: a package) with these
    comfy_api classes and a temp folder."""
    import importlib
    import sys

    (tmp_path / "seedvr2_pack").symlink_to(REPO, target_is_directory=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    pack_nodes = importlib.import_module("seedvr2_pack.nodes")
    latest = types.ModuleType("comfy_api.latest")
    latest.InputImpl = types.SimpleNamespace(VideoFromFile=VideoFromFile, VideoFromList=VideoFromList,
                                             VideoFromComponents=VideoFromComponents)
    monkeypatch.setitem(sys.modules, "comfy_api", types.ModuleType("comfy_api"))
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    temp = tmp_path / "temp"

    def save_path(prefix, folder, *size):  # folder_paths.get_save_image_path, numbered anew
        target = Path(folder) / Path(prefix).parent
        target.mkdir(parents=True, exist_ok=True)
        return str(target), Path(prefix).name, len(list(target.iterdir())) + 1, "", prefix
    monkeypatch.setattr(pack_nodes, "folder_paths", types.SimpleNamespace(
        get_temp_directory=lambda: str(temp), get_save_image_path=save_path))
    yield pack_nodes.ComfyHost()
    for name in [n for n in sys.modules if n.split(".")[0] == "seedvr2_pack"]:
        del sys.modules[name]


def _frames(path) -> np.ndarray:
    with open_media(path) as media:
        return np.stack(list(media.frames()))


def test_an_in_memory_container_is_copied_to_the_temp_folder_and_streamed(comfy_host,
                                                                          tmp_path, tiny_options):
    import seedvr2

    clip = tmp_path / "clip.mp4"
    make_clip(clip, frames=6)
    data = clip.read_bytes()
    video = VideoFromFile(io.BytesIO(data))
    path = comfy_host.video_file(video)
    assert path.parent == tmp_path / "temp" / "SeedVR2" and path.read_bytes() == data
    assert video.file.tell() == 0  # left at its start for ComfyUI's next reader
    # What the node does with it: stream it, audio and rate kept.
    out = seedvr2.upscale_file(path, tmp_path / "out.mp4", **tiny_options, resolution=32,
                               text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))
    with open_media(out) as media, open_media(clip) as source:
        assert (media.info.frame_count, media.info.fps, media.info.has_audio) == \
            (6, source.info.fps, True)
    # An edit only frames can show (here a trim) is still taken as frames.
    assert comfy_host.video_file(VideoFromFile(io.BytesIO(data), start_time=0.2)) is None


def test_a_concatenation_is_written_part_by_part(comfy_host, tmp_path):
    """Parts on disk and in memory, joined one frame at a time (the whole video is never in
    memory: the traced peak stays near one frame), at crf 0; the concatenation's soundtrack
    goes with it."""
    width, height, count, rate = 320, 240, 16, 16000
    parts = []
    for i in range(2):
        path = tmp_path / f"part{i}.mp4"
        _clip(path, width, height, count, shade=100 * i)
        parts.append(path)
    in_memory = VideoFromFile(io.BytesIO(parts[1].read_bytes()))
    seconds = 2 * count / 24
    waveform = torch.sin(torch.arange(int(seconds * rate)) / 30.0)[None, None] * 0.3
    video = VideoFromList([VideoFromFile(str(parts[0])), VideoFromList([in_memory])],
                          complete_audio={"waveform": waveform, "sample_rate": rate})
    assert comfy_host.video_size(video) == (2 * count, height, width, False)
    import importlib

    import av  # noqa: F401 (imported before the trace: module code is not the video)
    importlib.import_module("seedvr2_pack.src.seedvr2.io.joined")
    tracemalloc.start()
    try:
        joined = comfy_host.video_file(video)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    frame = width * height * 3
    assert peak < 4 * frame < 2 * count * frame, peak  # a frame at a time, not the 32
    # The joined video (and its soundtrack) stays; the in-memory part's copy is gone.
    assert joined.name.startswith("joined_") and joined.suffix == ".mp4"
    assert [p.name for p in joined.parent.iterdir() if p.name.startswith("input_")] == []
    with open_media(joined) as media:
        info = media.info
        assert (info.frame_count, info.width, info.height, info.fps, info.has_audio) == \
            (2 * count, width, height, Fraction(24), True)
    got, want = _frames(joined), np.concatenate([_frames(p) for p in parts])
    # 4:2:0 pixels kept losslessly; only the RGB <-> YUV rounding differs.
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 3
    with open_media(joined) as media:
        assert abs(media.info.frame_count / media.info.fps - seconds) < 0.05


def _clip(path, width, height, frames, shade):
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            pixels = np.full((height, width, 3), shade, np.uint8)
            pixels[:, (7 * i) % width] = 255
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def test_a_concatenation_with_an_edited_part_is_taken_as_frames_after_a_size_check(
        comfy_host, tmp_path, monkeypatch, caplog):
    """Only frames can show a trimmed part: the size is logged before anything is taken, and
    a video that cannot fit the RAM is refused with the way out."""
    from seedvr2.memory import budget
    from seedvr2.memory.budget import BudgetError
    from seedvr2.options import resolve_options
    from seedvr2.workflow.nodes import _check_frames_fit

    clip = tmp_path / "clip.mp4"
    make_clip(clip, frames=20)
    video = VideoFromList([VideoFromFile(str(clip)), VideoFromFile(str(clip), start_time=0.1)])
    assert comfy_host.video_file(video) is None
    size = comfy_host.video_size(video)
    assert size == (40, 48, 64, False)
    opts = resolve_options(resolution=480)  # 64x48 -> 640x480
    need = 40 * 48 * 64 * 3 * 4 + 40 * 480 * 640 * 3 * 4
    monkeypatch.setattr(budget, "host_available", lambda: need)
    with caplog.at_level(logging.INFO, logger="seedvr2"):
        _check_frames_fit(size, opts)
    assert ("the VIDEO is upscaled in memory: 40 frames of 64x48 taken into RAM (1 MiB) and "
            "141 MiB upscaled to 640x480: 142 MiB of RAM (142 MiB available)") in caplog.text
    monkeypatch.setattr(budget, "host_available", lambda: need // 2)
    with pytest.raises(BudgetError) as refused:
        _check_frames_fit(size, opts)
    assert str(refused.value) == (
        "the VIDEO (40 frames of 64x48) is not a file that can be streamed (frames, a trimmed "
        "or cropped video, or a concatenation of such), so it would be upscaled in memory: "
        "142 MiB of RAM for its frames and the upscaled ones at 640x480, but 71 MiB is "
        "available. Save it with Save Video and upscale that file (Load Video, or SeedVR2 "
        "Upscale Video File): a file is streamed, any length fits; or upscale fewer frames")


def test_frames_already_in_memory_count_only_the_upscaled_ones(comfy_host, monkeypatch):
    from seedvr2.memory import budget
    from seedvr2.options import resolve_options
    from seedvr2.workflow.nodes import _check_frames_fit

    components = types.SimpleNamespace(images=torch.zeros(5, 48, 64, 3), audio=None,
                                       frame_rate=Fraction(24))
    video = VideoFromComponents(components)
    assert comfy_host.video_file(video) is None
    assert comfy_host.video_size(video) == (5, 48, 64, True)
    monkeypatch.setattr(budget, "host_available", lambda: 5 * 480 * 640 * 3 * 4)
    _check_frames_fit(comfy_host.video_size(video), resolve_options(resolution=480))


def test_a_release_without_frames_for_a_concatenation_says_what_to_do(comfy_host):
    class OldVideoFromList(VideoFromList):
        def get_components(self):
            raise NotImplementedError

    # (the pack's own copy of the library raises it: seedvr2_pack.src.seedvr2.io.MediaError)
    with pytest.raises(ValueError, match="cannot give the frames of a OldVideoFromList .*: save "
                       "the video with Save Video and upscale that file") as refused:
        comfy_host.video_frames(OldVideoFromList([]))
    assert [c.__name__ for c in type(refused.value).__mro__[:3]] == \
        ["MediaError", "SeedVR2Error", "ValueError"]


def test_parts_of_different_sizes_are_refused_naming_the_part(tmp_path):
    from seedvr2.io import MediaError
    from seedvr2.io.joined import join_videos

    _clip(tmp_path / "a.mp4", 64, 48, 3, shade=0)
    _clip(tmp_path / "b.mp4", 96, 48, 3, shade=50)
    with pytest.raises(MediaError) as refused:
        join_videos([tmp_path / "a.mp4", tmp_path / "b.mp4"], tmp_path / "joined.mp4")
    assert str(refused.value) == (f"{tmp_path / 'b.mp4'}: part 1 of the joined video is 96x48 "
                                  f"(3 channels), part 0 64x48 (3): the parts of one video must "
                                  f"have one size")
    assert not (tmp_path / "joined.mp4").exists()  # the writer removed its partial file


@pytest.fixture(scope="module")
def clip_bytes(tmp_path_factory) -> bytes:
    clip = tmp_path_factory.mktemp("hostile") / "clip.mp4"
    make_clip(clip, frames=4)
    return clip.read_bytes()


def _hostile_container():
    from hypothesis import strategies as st

    return st.one_of(
        st.binary(max_size=2048),  # not a video at all
        st.integers(0, 100).map(lambda percent: ("cut", percent)),  # a truncated container
        st.tuples(st.integers(0, 99), st.binary(min_size=1, max_size=64)).map(
            lambda damage: ("damaged", *damage)))  # bytes overwritten mid-file


def test_a_hostile_in_memory_container_is_streamed_or_refused_cleanly(comfy_host, clip_bytes):
    """Bytes a node handed over as a VIDEO: a clean MediaError naming the copy in the temp
    folder, or the frames a reader finds; never another exception."""
    from hypothesis import given

    from hostile import outcome

    @given(_hostile_container())
    def check(spec):
        if isinstance(spec, bytes):
            data = spec
        elif spec[0] == "cut":
            data = clip_bytes[: len(clip_bytes) * spec[1] // 100]
        else:
            at = len(clip_bytes) * spec[1] // 100
            data = clip_bytes[:at] + spec[2] + clip_bytes[at + len(spec[2]):]
        path = comfy_host.video_file(VideoFromFile(io.BytesIO(data)))
        assert path is not None and path.read_bytes() == data

        def read():
            with open_media(path) as media:
                return sum(1 for _ in media.frames())
        result = outcome(read, str(path))
        assert result.refused or result.value <= 4
    check()
