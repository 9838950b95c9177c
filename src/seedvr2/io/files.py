"""A file job's files: what it reads (the input's files, its frame count), the writer of its
output, and the refusal of an output that would destroy an input (docs/resume.md)."""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..options import option_value, parse_fps
from ._common import IMAGE_EXTENSIONS, PRINTF, MediaError, printf_pattern
from .writer import OutputSpec, open_writer

VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv")


@dataclass(frozen=True)
class FileOutput:
    """Where and how a file job writes: built once per job from the input's header."""

    dst: Any
    size: tuple[int, int]  # (H, W)
    bit_depth: int
    codec: str = "h264"
    overwrite: bool = False
    fps: str = "auto"  # the option: a rate for images written as a video

    @property
    def is_video(self) -> bool:
        return Path(str(self.dst)).suffix.lower() in VIDEO_SUFFIXES

    def open(self, info):
        """The writer of the output, copying ``info``'s audio and subtitles where it holds them, and
        a variable-rate source's frame times; ``fps`` gives images a rate."""
        rate = parse_fps(self.fps)
        if rate is not None and info.fps is not None:
            warnings.warn(f"{option_value('fps', self.fps)} ignored: {info.path} is a video and "
                          f"keeps its own rate ({float(info.fps):.6g} fps), so its sound stays "
                          f"in sync", stacklevel=2)
            rate = None
        spec = OutputSpec(width=self.size[1], height=self.size[0], bit_depth=self.bit_depth,
                          codec=self.codec, fps=rate, audio_from=info)
        return open_writer(self.dst, spec, like=info, overwrite=self.overwrite)


def input_files(reader) -> list[Path]:
    """The files a file job reads: the video or image, or every file of an image sequence."""
    files = getattr(reader, "files", None)
    return [Path(f) for f in files] if files is not None else [Path(reader.info.path)]


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _numbered_names(out: Path, folder_output: bool) -> str:
    """A regular expression of the names beside ``out`` a writer may number (an image
    output's whatever its frame count, which a video's header may not tell exactly yet)."""
    if folder_output:
        return r"\d+\.png"
    if out.suffix.lower() not in IMAGE_EXTENSIONS:
        return r"(?!)"
    if PRINTF.search(out.name):
        prefix, _, suffix = printf_pattern(out)
        return re.escape(prefix) + r"\d+" + re.escape(suffix)
    return re.escape(out.stem) + r"_\d+" + re.escape(out.suffix)


def refuse_input_as_output(inputs, dst) -> None:
    """Raise :class:`~seedvr2.io.MediaError` when writing ``dst`` would replace or delete one
    of ``inputs``, whatever ``overwrite`` says: the same file by any path (device and inode),
    or a numbered file the writer may replace or delete (docs/resume.md)."""
    text = os.fspath(dst)
    out = Path(text)
    folder_output = text.endswith(("/", os.sep)) or out.is_dir()
    try:
        out_stat = os.stat(out)
    except OSError:
        out_stat = None
    try:
        parent_stat = os.stat(out if folder_output else out.parent)
    except OSError:
        return  # the output's folder does not exist yet: it holds no input
    numbered = re.compile(_numbered_names(out, folder_output), re.IGNORECASE)
    for source in inputs:
        source = Path(source)
        try:
            source_stat, source_parent = os.stat(source), os.stat(source.parent)
        except OSError:
            continue
        if not folder_output and out_stat is not None and _same_file(out_stat, source_stat):
            same = "" if os.path.abspath(source) == os.path.abspath(out) else \
                f" (the same file as the input {source})"
            raise MediaError(f"{dst} is the job's input{same}: writing the output there would "
                             f"destroy it, with or without overwrite; choose another output name")
        if _same_file(parent_stat, source_parent) and numbered.fullmatch(source.name):
            raise MediaError(f"{dst}: the output would replace the input {source}, with or "
                             f"without overwrite; choose another output "
                             f"{'folder' if folder_output else 'name'}")


def frame_count(reader) -> int:
    info = reader.info
    return info.frame_count if info.frame_count_exact else reader.count_frames()
