"""Media in and out as frame streams: videos (PyAV, audio passthrough), images, image sequences.

The upscaler never holds a whole video: it reads frames in order (or from a start frame),
processes them in chunks and writes results as they come. This package gives it exactly that:

    from seedvr2.io import open_media, open_writer

    with open_media("in.mp4") as src:                     # or an image, a folder, "f/%05d.png"
        info = src.info                                   # MediaInfo: size, fps, count, ...
        with open_writer("out.mp4", like=info, width=2 * info.width, height=2 * info.height,
                         audio_from=info) as dst:         # audio copied, not re-encoded
            for frame in src.frames(start=0):             # (H, W, C) uint8 / uint16 arrays
                dst.write(upscale(frame))
    # out.mp4 appears only now; an exception inside ``with`` leaves nothing behind.

Contracts (what each format keeps and drops, for users: docs/media.md):

* Frames are numpy (H, W, C) arrays, C = 1 (gray), 3 (RGB) or 4 (RGBA), uint8 or uint16.
  Sources with more than 8 bits (10-bit video, 16-bit PNG/TIFF) arrive as uint16 scaled to
  the full 16-bit range; gray+alpha becomes RGBA. Frame ``i`` is the ``i``-th frame in
  presentation order, whichever ``start`` it is read from.
* Readers and writers stream, one frame at a time; writers never lose or clobber work
  (:mod:`seedvr2.io.writer`).
* Errors are :class:`MediaError` (a ValueError) naming the file, except refusing to
  overwrite, which is a :class:`FileExistsError`.
* ``import seedvr2.io`` stays cheap: PyAV and Pillow are imported inside the functions
  that use them, so the ComfyUI pack can import this at startup.
"""

from ._common import MediaError, MediaInfo
from .audio import encode_audio
from .reader import (AnimationReader, ImageReader, MediaReader, SequenceReader, VideoReader,
                     open_media)
from .writer import ImageWriter, MediaWriter, SequenceWriter, VideoWriter, open_writer

__all__ = [
    "MediaError", "MediaInfo", "encode_audio", "open_media", "open_writer",
    "MediaReader", "VideoReader", "ImageReader", "AnimationReader", "SequenceReader",
    "MediaWriter", "VideoWriter", "ImageWriter", "SequenceWriter",
]
