"""Headless equivalents of the ComfyUI core nodes our example workflows use (docs/comfyui.md,
"Without the editor"), with ComfyUI's types, input names, order, defaults and outputs (a test
compares a server's ``/object_info``). VIDEO values are :class:`Video`; AUDIO is ComfyUI's
``{"waveform", "sample_rate"}``, or ``{"source": path}``: a file's track, SaveVideo copies it."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Optional

from ..errors import InputError
from .nodes import Input, NodeDef, NodeResult, Output, output_prefix

_CORE = "core (headless)"


@dataclass
class Video:
    """A video: a file, or frames (T, H, W, C) in [0, 1] with a frame rate and optional audio."""

    path: Optional[Path] = None
    images: object = None
    fps: Optional[float] = None
    audio: Optional[dict] = None


def _load_image(host, image: str) -> NodeResult:
    import numpy as np
    import torch
    from PIL import Image, ImageOps

    path = host.input_path(image)
    if not path.is_file():
        raise InputError(f"image {image!r}: no such file in the input folder {path.parent}")
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        rgb = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
        if "A" in im.getbands():
            mask = 1.0 - np.asarray(im.getchannel("A"), dtype=np.float32) / 255.0
        else:
            mask = np.zeros((64, 64), dtype=np.float32)  # ComfyUI's "no mask"
    return NodeResult((torch.from_numpy(rgb)[None], torch.from_numpy(mask)[None]))


def _save_images(host, images, filename_prefix: str = "ComfyUI") -> NodeResult:
    import numpy as np
    from PIL import Image

    saved = []
    for frame in images:
        height, width = frame.shape[:2]
        path, entry = host.output_file(output_prefix(filename_prefix, "ComfyUI"), ".png", width,
                                       height)
        pixels = np.clip(frame.cpu().numpy() * 255.0, 0, 255).astype(np.uint8)
        Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(path)
        saved.append(entry)
    return NodeResult(ui={"images": saved})


def _preview_images(host, images) -> NodeResult:
    host.warn(f"PreviewImage: {len(images)} frame(s) of {images.shape[2]}x{images.shape[1]} "
              f"(headless: nothing is shown)")
    return NodeResult(ui={})


def _load_video(host, file: str) -> NodeResult:
    path = host.input_path(file)
    if not path.is_file():
        raise InputError(f"file {file!r}: no such video in the input folder {path.parent}")
    return NodeResult((Video(path=path),))


def video_components(video: Video) -> tuple:
    """(frames, audio or None, frame rate) of a video, as Get Video Components outputs them."""
    if video.path is None:
        return video.images, video.audio, float(video.fps)
    import torch

    from ..io import open_media, refuse_hdr
    from ..pipeline.runner import to_float_frame

    with open_media(video.path) as reader:
        refuse_hdr(reader.info, "an IMAGE batch")
        frames = [to_float_frame(f, i)[..., :3] for i, f in enumerate(reader.frames())]
        info = reader.info
    audio = {"source": str(video.path)} if info.has_audio else None
    return torch.stack(frames), audio, float(info.fps or 0.0)


def _get_video_components(host, video: Video) -> NodeResult:
    return NodeResult(video_components(video))


def _create_video(host, images, fps: float, audio: Optional[dict] = None) -> NodeResult:
    return NodeResult((Video(images=images, fps=fps, audio=audio),))


def _save_video(host, video: Video, filename_prefix: str = "video/ComfyUI", format: str = "auto",
                codec: str = "auto") -> NodeResult:
    import numpy as np

    from ..io import OutputSpec, open_writer

    images, audio, fps = video_components(video)
    height, width = images.shape[1:3]
    path, entry = host.output_file(output_prefix(filename_prefix, "video/ComfyUI"), ".mp4", width,
                                   height)
    rate = Fraction(fps).limit_denominator(1001)
    with tempfile.TemporaryDirectory(prefix="seedvr2_audio_") as scratch:
        audio_from = _audio_file(audio, Path(scratch))
        spec = OutputSpec(width=width, height=height, channels=3, bit_depth=8, fps=rate,
                          audio_from=audio_from)
        with open_writer(path, spec, overwrite=True) as writer:
            for frame in images:
                writer.write(np.clip(frame[..., :3].cpu().numpy() * 255.0 + 0.5, 0, 255)
                             .astype(np.uint8))
    return NodeResult(ui={"images": [entry], "animated": [True]})


def _audio_file(audio: Optional[dict], scratch: Path) -> Optional[Path]:
    """The file whose audio SaveVideo copies: the source, or in-memory audio as AAC in scratch."""
    if audio is None:
        return None
    if not isinstance(audio, dict):
        raise InputError(f"audio: expected an AUDIO value, not {type(audio).__name__}")
    if "source" in audio:
        return Path(audio["source"])
    if "waveform" not in audio or "sample_rate" not in audio:
        raise InputError("audio: expected {'waveform': tensor, 'sample_rate': int} (ComfyUI's "
                         "AUDIO)")
    from ..io import encode_audio

    return encode_audio(audio["waveform"], audio["sample_rate"], scratch / "audio.m4a")


def _input_files(host) -> list:
    return host.input_names()


CORE_NODES = (
    NodeDef("LoadImage", "Load Image", "Load an image from the input folder.",
            (Input("image", "COMBO", "an image in the input folder", choices=_input_files,
                   upload="image_upload"),),
            (Output("IMAGE", "IMAGE", ""), Output("MASK", "MASK", "")), _load_image,
            category=_CORE),
    NodeDef("SaveImage", "Save Image", "Save images to the output folder.",
            (Input("images", "IMAGE", "The images to save."),
             Input("filename_prefix", "STRING", "The prefix for the file to save.", "ComfyUI")),
            (), _save_images, output_node=True, category=_CORE),
    NodeDef("PreviewImage", "Preview Image", "Show images (headless: nothing).",
            (Input("images", "IMAGE", ""),), (), _preview_images, output_node=True,
            category=_CORE),
    NodeDef("LoadVideo", "Load Video", "Load a video from the input folder.",
            (Input("file", "COMBO", "a video in the input folder", choices=_input_files,
                   upload="video_upload"),),
            (Output("VIDEO", "VIDEO", ""),), _load_video, category=_CORE),
    NodeDef("GetVideoComponents", "Get Video Components",
            "Extracts all components from a video: frames, audio, and framerate.",
            (Input("video", "VIDEO", "The video to extract components from."),),
            (Output("images", "IMAGE", ""), Output("audio", "AUDIO", ""), Output("fps", "FLOAT", "")),
            _get_video_components, category=_CORE),
    NodeDef("CreateVideo", "Create Video", "Create a video from images.",
            (Input("images", "IMAGE", "The images to create a video from."),
             Input("fps", "FLOAT", "", 30.0, min=1.0, max=120.0, step=1.0),
             Input("audio", "AUDIO", "The audio to add to the video.", optional=True)),
            (Output("VIDEO", "VIDEO", ""),), _create_video, category=_CORE),
    NodeDef("SaveVideo", "Save Video", "Saves the input images to your output directory.",
            (Input("video", "VIDEO", "The video to save."),
             Input("filename_prefix", "STRING", "The prefix for the file to save.",
                   "video/ComfyUI"),
             Input("format", "COMBO", "The format to save the video as.", "auto",
                   choices=("auto", "mp4")),
             Input("codec", "COMBO", "The codec to use for the video.", "auto",
                   choices=("auto", "h264"))),
            (), _save_video, output_node=True, category=_CORE),
)
