"""Audio held in memory, encoded to a file the video writer can copy from."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from ._common import MediaError

AUDIO_LAYOUTS = {1: "mono", 2: "stereo"}
# The sample rates FFmpeg's AAC encoder opens at (its ``supported_samplerates``).
AAC_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000,
             7350)


def encode_audio(waveform, sample_rate: int, path: Path, name: str = "audio") -> Path | None:
    """Write a waveform ((batch, channels, samples) as ComfyUI's AUDIO holds it, or
    (channels, samples); float in [-1, 1]; batch items one after the other) as AAC in an MP4
    container at ``path``, ready to be copied into a video by ``OutputSpec(audio_from=...)``;
    None for a waveform of no samples (no audio). ``name``: the audio, in refusals."""
    import av
    import numpy as np
    import torch

    try:
        wave = torch.as_tensor(waveform).detach().to("cpu", torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise MediaError(f"{name}: the waveform is a {type(waveform).__name__}, not an array "
                         f"of samples") from None
    if wave.dim() == 3:
        wave = torch.cat(list(wave), dim=-1)  # (channels, batch * samples)
    if wave.dim() != 2:
        raise MediaError(f"{name}: waveform of shape {tuple(wave.shape)}; expected (batch, "
                         f"channels, samples)")
    channels = wave.shape[0]
    if channels not in AUDIO_LAYOUTS:
        raise MediaError(f"{name}: {channels} channels; only mono or stereo can be encoded")
    if sample_rate not in AAC_RATES:
        raise MediaError(f"{name}: sample rate {sample_rate!r}; AAC encodes "
                         f"{', '.join(map(str, AAC_RATES))} Hz: resample the audio")
    if not torch.isfinite(wave).all():
        raise MediaError(f"{name}: the waveform holds NaN or infinite samples")
    if wave.shape[1] == 0:
        return None
    sample_rate = int(sample_rate)
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
