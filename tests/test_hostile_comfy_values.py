"""Property-based hostile tests of the values ComfyUI hands SeedVR2 Upscale Video (Hypothesis;
the invariant in tests/hostile.py).

VIDEO inputs as ComfyUI builds them (comfy_api/latest/_input_impl/video_types.py, stood in as
in test_comfy_video_inputs.py): ``VideoFromFile`` over a clip, ``VideoFromComponents`` with an
IMAGE batch or a list of frames (of one size or not) and any frame rate, ``VideoFromList`` of
0, 1 or several parts with a soundtrack (``complete_audio``) of any rate, shape, NaN samples or
none; with the node's own inputs beside them. The node runs the tiny models on the CPU. The
outcome is one clean refusal of ours naming the input, or a VIDEO with every input frame
upscaled, at the input's frame rate.
"""

from __future__ import annotations

import os
import sys
import types
from fractions import Fraction

import pytest
import torch
from hypothesis import event, given, settings, strategies as st

from conftest import make_clip
from test_comfy_video_inputs import (VideoFromComponents, VideoFromFile, VideoFromList,  # noqa: F401
                                     comfy_host)

from seedvr2.io import open_media

CLIP_FRAMES = 3


def few(n: int):
    return settings(max_examples=n) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" \
        else settings()


def _ours(error: BaseException) -> bool:
    """A SeedVR2Error of the library or of the pack's own copy (seedvr2_pack.src.seedvr2)."""
    return any(c.__name__ == "SeedVR2Error" for c in type(error).__mro__)


def audio_dicts():
    samples = st.sampled_from([0, 1, 800])
    shapes = st.one_of(samples.map(lambda n: (1, 1, n)), samples.map(lambda n: (1, 2, n)),
                       samples.map(lambda n: (2, 1, n)), samples.map(lambda n: (1, 3, n)),
                       samples.map(lambda n: (n,)))
    rates = st.sampled_from([48000, 44100, 16000, 8000, 1, 0, -1, 12345, 48000.0,
                             float("nan")])
    return st.builds(lambda shape, rate, nan: {
        "waveform": torch.full(shape, float("nan")) if nan and 0 not in shape else
        torch.sin(torch.arange(shape[-1] if shape else 0) / 9.0).expand(shape) * 0.3,
        "sample_rate": rate}, shapes, rates, st.booleans())


def _shown(audio) -> str:
    if audio is None:
        return "None"
    wave = audio["waveform"]
    nan = " NaN" if wave.numel() and bool(wave.isnan().any()) else ""
    return f"{{waveform {tuple(wave.shape)}{nan}, sample_rate {audio['sample_rate']}}}"


def _video_repr(video) -> str:
    if isinstance(video, VideoFromList):
        return f"VideoFromList({len(video.videos)} parts, complete_audio=" \
               f"{_shown(video.complete_audio)})"
    return repr(video) if not isinstance(video, VideoFromFile) else "VideoFromFile(clip)"


@st.composite
def videos(draw, clip):
    kind = draw(st.sampled_from(["file", "components", "frame list", "list"]))
    if kind == "file":
        return VideoFromFile(str(clip))
    if kind == "list":
        parts = [VideoFromFile(str(clip)) for _ in range(draw(st.sampled_from([0, 1, 2])))]
        return VideoFromList(parts, complete_audio=draw(st.none() | audio_dicts()))
    count = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.sampled_from([(24, 32), (24, 32), (32, 24)]), min_size=count,
                          max_size=count))
    frames = [torch.rand(h, w, 3, generator=torch.Generator().manual_seed(i))
              for i, (h, w) in enumerate(sizes)]
    images = frames if kind == "frame list" else torch.stack(frames) \
        if len(set(sizes)) == 1 else frames
    rate = draw(st.sampled_from([Fraction(24), Fraction(30000, 1001), Fraction(0)]))
    components = types.SimpleNamespace(images=images, audio=draw(st.none() | audio_dicts()),
                                       frame_rate=rate)
    return VideoComponentsVideo(components)


class VideoComponentsVideo(VideoFromComponents):
    def __repr__(self):
        c = self.components
        images = f"list of {[tuple(f.shape) for f in c.images]}" \
            if isinstance(c.images, list) else f"tensor {tuple(c.images.shape)}"
        return f"VideoFromComponents(images={images}, audio={_shown(c.audio)}, " \
               f"frame_rate={c.frame_rate})"

    def get_dimensions(self):  # a list of frames: the first one's (core reads images.shape)
        first = self.components.images[0] if len(self.components.images) else None
        return (first.shape[1], first.shape[0]) if first is not None else (0, 0)

    def get_frame_count(self):
        return len(self.components.images)


@pytest.fixture
def host(comfy_host, tiny_model_dir, tmp_path, monkeypatch):
    """ComfyHost's VIDEO methods (the stand-in comfy_api) on a headless host's model handling."""
    from seedvr2.workflow.host import HeadlessHost

    latest = sys.modules["comfy_api.latest"]
    latest.Types = types.SimpleNamespace(VideoComponents=types.SimpleNamespace)
    latest.InputImpl.VideoFromComponents = VideoFromComponents
    headless = HeadlessHost(model_dir=tiny_model_dir, input_dir=tmp_path,
                            output_dir=tmp_path / "out", quiet=True)
    for name in ("video_file", "video_size", "video_frames", "file_video", "frames_video",
                 "temp_file"):
        monkeypatch.setattr(headless, name, getattr(comfy_host, name))
    return headless


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("comfy_values") / "clip.mp4"
    make_clip(path, frames=CLIP_FRAMES)
    return path


def _handles(tiny_model_dir):
    from seedvr2.workflow import nodes as defs

    settings_ = {kind: tuple((s.input, s.node_input().default)
                             for s in defs.LOADER_SETTINGS[kind]) for kind in ("dit", "vae")}
    return (defs.ModelHandle("dit", "dit", str(tiny_model_dir / "dit3b_tiny.safetensors"),
                             settings_["dit"]),
            defs.ModelHandle("vae", "vae", str(tiny_model_dir / "vae_tiny.safetensors"),
                             settings_["vae"]))


def _frame_count(video) -> tuple[int, Fraction]:
    """(frames, frame rate) of the VIDEO the node returned."""
    if isinstance(video, VideoFromFile):
        with open_media(video.file) as media:
            return media.info.frame_count, media.info.fps
    return len(video.components.images), video.components.frame_rate


def _expected(video) -> tuple[int, object]:
    """(frames, frame rate) the input VIDEO shows."""
    if isinstance(video, VideoFromList):
        return CLIP_FRAMES * len(video.videos), None
    if isinstance(video, VideoFromFile):
        return CLIP_FRAMES, None
    return len(video.components.images), video.components.frame_rate


@few(12)
@given(data=st.data())
def test_comfy_video_values_upscale_or_are_refused_naming_the_input(host, clip, tiny_model_dir,
                                                                     data):
    from seedvr2.workflow import nodes as defs

    video = data.draw(videos(clip), "video")
    data.draw(st.just(_video_repr(video)), "the video, shown")
    inputs = {s.input: s.node_input().default for s in defs.UPSCALER_SETTINGS}
    inputs.update(resolution=data.draw(st.sampled_from([16, 32]), "resolution"),
                  batch_size=data.draw(st.sampled_from([1, 5]), "batch_size"),
                  devices="cpu", offload_device="none", seed=1)
    inputs = {k: v for k, v in inputs.items() if k != "codec"}
    dit, vae = _handles(tiny_model_dir)
    try:
        result = defs._upscale_video(host, video, dit, vae, "h264", **inputs)
    except Exception as e:
        assert _ours(e), f"{type(e).__name__}: {e}"
        assert str(e).strip()
        event(f"refused: {str(e)[-70:]}")
        return
    event(f"upscaled a {type(video).__name__}")
    (out,) = result.outputs
    frames, rate = _frame_count(out)
    want_frames, want_rate = _expected(video)
    assert frames == want_frames, f"{want_frames} frames in, {frames} out"
    assert rate > 0, f"a VIDEO of frame rate {rate}"
    if want_rate is not None:
        assert rate == want_rate


# ---------------------------------------------------------------------------------------------
# the defects the generator found (issue 44, 2.6, 2.7, 2.9), one test each


def test_frames_as_a_list_are_stacked_or_refused_naming_the_frame():
    """A VIDEO's images as a list of frames (VideoComponents may hold one), or
    ``seedvr2.upscale([t1, t2])``: a raw ValueError from torch.as_tensor before."""
    from seedvr2.pipeline.runner import InputError, input_frames

    a, b = torch.rand(24, 32, 3), torch.rand(24, 32, 3)
    assert torch.equal(input_frames([a, b]), input_frames(torch.stack([a, b])))
    with pytest.raises(InputError) as refused:
        input_frames([a, torch.rand(32, 24, 3)])
    assert str(refused.value) == ("frame 1 is (32, 24, 3) torch.float32, frame 0 (24, 32, 3) "
                                  "torch.float32: the frames of one video must have one size")
    with pytest.raises(InputError, match="^frames: the input has no frames$"):
        input_frames([])


def test_an_empty_concatenation_is_refused_as_empty(comfy_host):
    """VideoFromList([]): a raw IndexError in join_videos before."""
    with pytest.raises(ValueError, match="the joined video has no parts: an empty video") as e:
        comfy_host.video_file(VideoFromList([]))
    assert _ours(e.value)


@pytest.mark.parametrize("rate, waveform, message", [
    (1, torch.zeros(1, 1, 800), "sample rate 1; AAC encodes 96000, "),
    (12345, torch.zeros(1, 2, 800), "sample rate 12345; AAC encodes "),
    (48000, torch.full((1, 1, 800), float("nan")), "the waveform holds NaN or infinite samples"),
])
def test_a_soundtrack_the_encoder_cannot_take_is_refused_naming_it(comfy_host, clip, rate,
                                                                   waveform, message):
    """PyAV failed with 'avcodec_open2("aac") returned 22' (rate 1) or
    'avcodec_send_frame returned 22' (NaN samples), naming nothing."""
    video = VideoFromList([VideoFromFile(str(clip))],
                          complete_audio={"waveform": waveform, "sample_rate": rate})
    with pytest.raises(ValueError) as refused:
        comfy_host.video_file(video)
    assert _ours(refused.value)
    assert str(refused.value).startswith(f"the concatenation's audio: {message}"), refused.value


def test_a_soundtrack_of_no_samples_is_no_audio(comfy_host, clip):
    """Was 'audio source ...m4a: no such file'. No soundtrack: the parts' own audio, as for
    complete_audio None."""
    video = VideoFromList([VideoFromFile(str(clip))],
                          complete_audio={"waveform": torch.zeros(1, 2, 0), "sample_rate": 44100})
    with open_media(comfy_host.video_file(video)) as media:
        assert (media.info.frame_count, media.info.has_audio) == (CLIP_FRAMES, True)


def test_a_video_of_frame_rate_0_is_refused_before_upscaling(host, tiny_model_dir):
    """The node returned a VIDEO of frame rate 0 (no player or writer takes it)."""
    from seedvr2.workflow import nodes as defs

    components = types.SimpleNamespace(images=torch.rand(2, 24, 32, 3), audio=None,
                                       frame_rate=Fraction(0))
    inputs = {s.input: s.node_input().default for s in defs.UPSCALER_SETTINGS}
    inputs.pop("codec", None)
    with pytest.raises(ValueError) as refused:
        defs._upscale_video(host, VideoFromComponents(components), *_handles(tiny_model_dir),
                            "h264", **inputs)
    assert _ours(refused.value)
    assert str(refused.value) == ("video: its frame rate is 0 frames per second; give it a rate "
                                  "above 0 (Create Video's fps) and run again")
