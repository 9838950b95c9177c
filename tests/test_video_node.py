"""SeedVR2 Upscale Video: ComfyUI's VIDEO in and out (Load Video -> ours -> Save Video),
streamed when the video is a file, in memory when it is made of frames; headless here, in the
real ComfyUI in test_comfyui_server.py."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from example_workflows import EXAMPLE_VIDEO
from test_workflows import CLIP_FRAMES, VIDEO_OUT, inputs, probe_video  # noqa: F401 (fixture)

from seedvr2.workflow.host import HeadlessHost
from seedvr2.workflow.run import run_workflow

LOADERS = {
    "2": {"class_type": "SeedVR2LoadDiTModel",
          "inputs": {"model": "dit3b_tiny.safetensors", "device": "cpu", "offload_device": "none",
                     "cache_model": False, "blocks_to_swap": 0, "swap_io_components": False,
                     "attention_backend": "sdpa", "dtype": "auto", "text_embeddings": "auto"}},
    "3": {"class_type": "SeedVR2LoadVAEModel",
          "inputs": {"model": "vae_tiny.safetensors", "device": "cpu", "offload_device": "none",
                     "cache_model": False, "encode_tiled": False, "encode_tile_size": 512,
                     "encode_tile_overlap": 64, "decode_tiled": False, "decode_tile_size": 512,
                     "decode_tile_overlap": 64, "dtype": "auto"}},
}
UPSCALE = {"devices": "auto", "offload_device": "cpu", "seed": 42, "resolution": 64,
           "max_resolution": 0, "batch_size": 5, "uniform_batch_size": False,
           "temporal_overlap": 0, "prepend_frames": 0, "chunk_size": 0,
           "color_correction": "wavelet", "input_noise_scale": 0.0, "latent_noise_scale": 0.0,
           "codec": "h264"}


def video_prompt(from_frames: bool = False) -> dict:
    """Load Video -> SeedVR2 Upscale Video -> Save Video; ``from_frames``: the video is made of
    frames first (Get Video Components -> Create Video, with the clip's audio)."""
    prompt = {"1": {"class_type": "LoadVideo", "inputs": {"file": EXAMPLE_VIDEO}}, **LOADERS,
              "4": {"class_type": "SeedVR2UpscaleVideo",
                    "inputs": {"video": ["1", 0], "dit": ["2", 0], "vae": ["3", 0], **UPSCALE}},
              "5": {"class_type": "SaveVideo",
                    "inputs": {"video": ["4", 0], "filename_prefix": "upscaled/video",
                               "format": "auto", "codec": "auto"}}}
    if from_frames:
        prompt["6"] = {"class_type": "GetVideoComponents", "inputs": {"video": ["1", 0]}}
        prompt["7"] = {"class_type": "CreateVideo",
                       "inputs": {"images": ["6", 0], "audio": ["6", 1], "fps": 24.0}}
        prompt["4"]["inputs"]["video"] = ["7", 0]
    return prompt


def video_rate(path) -> Fraction:
    import av

    with av.open(str(path)) as container:
        return Fraction(container.streams.video[0].average_rate)


@pytest.mark.parametrize("from_frames", [False, True], ids=["file", "frames"])
def test_load_video_upscale_save_video_keeps_audio_and_rate_headless(from_frames, tiny_model_dir,
                                                                      inputs, tmp_path):
    host = HeadlessHost(model_dir=tiny_model_dir, input_dir=inputs, output_dir=tmp_path / "out",
                        quiet=True)
    streamed = []
    if not from_frames:  # the file is streamed: its frames are never all in memory at once
        original = host.video_frames
        host.video_frames = lambda video: streamed.append(video) or original(video)
    result = run_workflow(video_prompt(from_frames), host=host)
    (saved,) = result.files
    assert probe_video(saved) == (CLIP_FRAMES, VIDEO_OUT, True)
    assert video_rate(saved) == 24
    assert streamed == []


# -- ComfyUI's VIDEO with edits (current comfy_api: VideoFromFile(file, start_time=, duration=,
# crop=), as as_trimmed / as_cropped make it) --------------------------------------------------

FILE_SIZE = (640, 360)  # what the stand-in's file measures


class _CurrentVideoFromFile:
    """Shaped like current ComfyUI's InputImpl.VideoFromFile: trim and crop are kept beside the
    file and applied only when frames are made (get_components) or saved; get_stream_source is
    the unedited file; get_dimensions gives the crop's size. ``pending``: what
    has_pending_frame_edits answers (the base class: False; a release may answer for edits)."""

    def __init__(self, file, *, start_time=0, duration=0, crop=None, pending=False):
        self.file, self.start, self.duration, self.crop = file, start_time, duration, crop
        self.pending = pending

    def get_stream_source(self):
        return self.file

    def get_active_trim_window(self):
        return float(self.start), float(self.duration)

    def has_pending_frame_edits(self):
        return self.pending

    def get_dimensions(self):
        return self.crop[2:] if self.crop is not None else FILE_SIZE

    def as_cropped(self, x=0, y=0, width=0, height=0):
        return _CurrentVideoFromFile(self.file, start_time=self.start, duration=self.duration,
                                     crop=(x, y, width, height))


@pytest.fixture
def comfy_host(tmp_path, monkeypatch):
    """The pack's ComfyHost (imported as ComfyUI imports the pack: a package), with a
    comfy_api whose VideoFromFile is the stand-in above."""
    import importlib
    import sys
    import types

    from conftest import REPO

    (tmp_path / "seedvr2_pack").symlink_to(REPO, target_is_directory=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    pack_nodes = importlib.import_module("seedvr2_pack.nodes")
    latest = types.ModuleType("comfy_api.latest")
    latest.InputImpl = types.SimpleNamespace(VideoFromFile=_CurrentVideoFromFile)
    monkeypatch.setitem(sys.modules, "comfy_api", types.ModuleType("comfy_api"))
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    yield pack_nodes.ComfyHost()
    for name in [n for n in sys.modules if n.split(".")[0] == "seedvr2_pack"]:
        del sys.modules[name]


@pytest.mark.parametrize("edit", ["trim", "crop", "trim_and_crop", "pending"])
def test_an_edited_comfy_video_is_never_streamed_from_its_raw_file(comfy_host, edit):
    """The raw file is streamed only when the VIDEO shows all of it: otherwise the node reads
    the frames ComfyUI makes (get_components, which applies the trim and the crop)."""
    whole = _CurrentVideoFromFile("/videos/clip.mp4")
    assert comfy_host.video_file(whole) == Path("/videos/clip.mp4")
    # A crop of the whole frame is no edit.
    assert comfy_host.video_file(whole.as_cropped(0, 0, *FILE_SIZE)) == Path("/videos/clip.mp4")
    edited = {"trim": _CurrentVideoFromFile("/videos/clip.mp4", start_time=1.5, duration=2),
              "crop": whole.as_cropped(10, 20, 320, 180),
              "trim_and_crop": _CurrentVideoFromFile("/videos/clip.mp4", start_time=-2,
                                                     crop=(0, 0, 320, 360)),
              "pending": _CurrentVideoFromFile("/videos/clip.mp4", pending=True)}[edit]
    assert comfy_host.video_file(edited) is None
