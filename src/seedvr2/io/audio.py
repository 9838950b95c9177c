"""Audio held in memory, encoded to a file the video writer can copy from."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from ._common import MediaError

AUDIO_LAYOUTS = {1: "mono", 2: "stereo"}


def encode_audio(waveform, sample_rate: int, path: Path) -> Path:
    """Write a waveform ((batch, channels, samples) as ComfyUI's AUDIO holds it, or
    (channels, samples); float in [-1, 1]; batch items one after the other) as AAC in an MP4
    container at ``path``, ready to be copied into a video by ``open_writer(audio_from=...)``."""
    import av
    import numpy as np
    import torch

    wave = torch.as_tensor(waveform).detach().to("cpu", torch.float32)
    if wave.dim() == 3:
        wave = torch.cat(list(wave), dim=-1)  # (channels, batch * samples)
    if wave.dim() != 2:
        raise MediaError(f"audio: waveform of shape {tuple(waveform.shape)}; expected (batch, "
                         f"channels, samples)")
    channels = wave.shape[0]
    if channels not in AUDIO_LAYOUTS:
        raise MediaError(f"audio: {channels} channels; only mono or stereo can be encoded")
    if sample_rate <= 0:
        raise MediaError(f"audio: sample_rate = {sample_rate}")
    samples = np.ascontiguousarray(wave.clamp(-1.0, 1.0).numpy())
    layout = AUDIO_LAYOUTS[channels]
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=sample_rate, layout=layout)
        step = stream.codec_context.frame_size or 1024
        for start in range(0, samples.shape[1], step):
            frame = av.AudioFrame.from_ndarray(samples[:, start:start + step], format="fltp",
                                               layout=layout)
            frame.sample_rate, frame.pts = sample_rate, start
            frame.time_base = Fraction(1, sample_rate)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return path
