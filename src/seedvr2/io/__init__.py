"""Media in and out as frame streams: videos (PyAV, audio passthrough), images, image sequences.

``open_media(path)`` gives a reader of (H, W, C) uint8/uint16 frames,
``open_writer(path, OutputSpec(...), like=info)`` a writer that never loses or clobbers work; errors
are :class:`MediaError` naming the file. Contracts, an example and what each format keeps:
docs/media.md. PyAV and Pillow load inside the functions that use them: importing this stays cheap.
"""

from ._common import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaError, MediaInfo, refuse_hdr
from .audio import encode_audio
from .reader import (AnimationReader, ImageReader, MediaReader, SequenceReader, VideoReader,
                     open_media)
from .writer import (ImageWriter, MediaWriter, OutputSpec, SequenceWriter, VideoWriter,
                     open_writer)

__all__ = [
    "IMAGE_EXTENSIONS", "VIDEO_EXTENSIONS", "MediaError", "MediaInfo", "encode_audio",
    "open_media", "open_writer", "OutputSpec", "refuse_hdr",
    "MediaReader", "VideoReader", "ImageReader", "AnimationReader", "SequenceReader",
    "MediaWriter", "VideoWriter", "ImageWriter", "SequenceWriter",
]
