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

Design:

* An animated WebP or PNG, or a multi-page TIFF, gives every frame (with each frame's
  duration); written back to a format that animates (PNG, WebP, TIFF) it stays one
  animated file with the same timing and loop count.
* Frames come as stored; video outputs keep the source's rotation tag and pixel aspect,
  image outputs are turned upright with square pixels.
* Frames are numpy (H, W, C) arrays, C = 1 (gray), 3 (RGB) or 4 (RGBA), uint8 or uint16.
  Sources with more than 8 bits (10-bit video, 16-bit PNG/TIFF) arrive as uint16 scaled to
  the full 16-bit range; gray+alpha becomes RGBA. Frame ``i`` is the ``i``-th frame in
  presentation order, whichever ``start`` it is read from.
* Readers stream: videos decode lazily (seeking by timestamp for ``start > 0``), sequences
  load one file per frame. Writers stream too: each frame is encoded as it is written.
* Variable-frame-rate video is counted by decoding at open; ``MediaInfo.frame_times`` then
  holds every frame's presentation time, and video writers given ``like=`` (or
  ``frame_times=``) write those times, keeping the copied audio in sync.
* Writers never lose or clobber work: output goes to a hidden ``.name.partial-<random>``
  next to the destination and is moved into place only by a successful ``close()``; an
  existing output is replaced only with ``overwrite=True``; problems that can be known
  up front (folder, size, codec, container) are raised when the writer is opened.
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
