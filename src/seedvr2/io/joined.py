"""Several videos played one after the other, streamed into one file a frame at a time.

A VIDEO that is a concatenation (ComfyUI's ``VideoFromList``, from Concatenate Video) holds no
single file to stream from; :func:`join_videos` writes its parts one by one into a video the
upscaler then streams, so no part is ever whole in memory (docs/comfyui.md)."""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path
from typing import Optional, Sequence

from ._common import MediaError
from .audio import AUDIO_LAYOUTS, encode_audio
from .reader import open_media
from .writer import OutputSpec, open_writer

log = logging.getLogger("seedvr2")

# The joined file is an intermediate the upscaler reads once: H.264 at crf 0 (lossless for
# the 8-bit 4:2:0 pixels it holds; 10-bit sources keep 10 bits in H.265), fast to write.
JOIN_CRF, JOIN_PRESET = 0, "ultrafast"


def join_videos(parts: Sequence[Path], dst: Path, audio_from: Optional[Path] = None) -> Path:
    """Write the videos ``parts`` one after the other into ``dst``, a frame at a time, at the first
    part's size, rate and bit depth (a part of another size: :class:`MediaError` naming it). The
    audio is copied from ``audio_from`` when given (a concatenation's own soundtrack), else the
    parts' audio, one after the other, when every part has some. Returns ``dst``."""
    if not parts:
        raise MediaError("the joined video has no parts: an empty video (Concatenate Video of "
                         "nothing) has no frames to upscale")
    with open_media(parts[0]) as first:
        info = first.info
    if audio_from is None:
        audio_from = _joined_audio(parts, dst.with_name(dst.stem + "_audio.m4a"))
    codec = "h265" if info.bit_depth > 8 else "h264"
    spec = OutputSpec(width=info.width, height=info.height, channels=info.channels,
                      bit_depth=info.bit_depth, fps=info.fps or Fraction(24), codec=codec,
                      crf=JOIN_CRF, preset=JOIN_PRESET, audio_from=audio_from)
    with open_writer(dst, spec, overwrite=True) as writer:
        for number, part in enumerate(parts):
            with open_media(part) as reader:
                size = (reader.info.width, reader.info.height, reader.info.channels)
                if size != (info.width, info.height, info.channels):
                    raise MediaError(f"{part}: part {number} of the joined video is "
                                     f"{size[0]}x{size[1]} ({size[2]} channels), part 0 "
                                     f"{info.width}x{info.height} ({info.channels}): the parts "
                                     f"of one video must have one size")
                for frame in reader.frames():
                    writer.write(frame)
    return dst


def _joined_audio(parts: Sequence[Path], dst: Path) -> Optional[Path]:
    """The parts' audio one after the other, encoded at ``dst`` (at the first part's rate and
    channels); None when a part has none (said in the log when others do)."""
    tracks = [_decoded_audio(part) for part in parts]
    if all(track is None for track in tracks):
        return None
    if any(track is None for track in tracks):
        log.warning("the joined video has no audio: parts %s have none",
                    ", ".join(str(i) for i, t in enumerate(tracks) if t is None))
        return None
    import numpy as np

    rate = tracks[0][1]
    waves = [_resampled(wave, track_rate, rate, tracks[0][0].shape[0])
             for wave, track_rate in tracks]
    return encode_audio(np.concatenate(waves, axis=1), rate, dst)


def _decoded_audio(path: Path):
    """(float32 (channels, samples), sample rate) of the first audio stream, or None."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        layout = AUDIO_LAYOUTS.get(min(stream.channels, 2), "stereo")
        resampler = av.AudioResampler(format="fltp", layout=layout, rate=stream.rate)
        chunks = [f.to_ndarray() for packet in container.demux(stream)
                  for frame in packet.decode() for f in resampler.resample(frame)]
        chunks += [f.to_ndarray() for f in resampler.resample(None)]
    return (np.concatenate(chunks, axis=1) if chunks else np.zeros((1, 0), np.float32)), \
        stream.rate


def _resampled(wave, rate: int, target_rate: int, channels: int):
    """``wave`` (channels, samples) at ``target_rate`` with ``channels`` channels (linear)."""
    import numpy as np

    if wave.shape[0] != channels:
        wave = np.repeat(wave.mean(axis=0, keepdims=True), channels, axis=0)
    if rate == target_rate or wave.shape[1] == 0:
        return wave
    samples = round(wave.shape[1] * target_rate / rate)
    positions = np.linspace(0, wave.shape[1] - 1, samples)
    return np.stack([np.interp(positions, np.arange(wave.shape[1]), c) for c in wave]) \
        .astype(np.float32)
