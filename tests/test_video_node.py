"""SeedVR2 Upscale Video: ComfyUI's VIDEO in and out (Load Video -> ours -> Save Video),
streamed when the video is a file, in memory when it is made of frames; headless here, in the
real ComfyUI in test_comfyui_server.py."""

from __future__ import annotations

from fractions import Fraction

import pytest

from test_workflows import CLIP_FRAMES, VIDEO_OUT, inputs, probe_video  # noqa: F401 (fixture)

from seedvr2.workflow.examples import EXAMPLE_VIDEO
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
