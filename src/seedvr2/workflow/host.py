"""The headless :class:`~seedvr2.workflow.nodes.Host`: folders on disk, a tqdm bar, Ctrl-C."""

from __future__ import annotations

import gc
import logging
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Optional

from ..errors import InputError
from .core_nodes import Video, video_components
from .errors import WorkflowInterrupted

log = logging.getLogger("seedvr2")


def confined_input_path(name: str, folders: dict) -> Path:
    """The file a prompt's input name (LoadImage, LoadVideo, Upscale Video File) means, never
    outside the host's folders: anyone who reaches a ComfyUI started with ``--listen`` may send
    one. A path in ``folders["input"]``, or ComfyUI's ``"name [output]"`` (``[temp]``, ``[input]``)
    for the others; else InputError. Checked as written (normalized): links in a folder work."""
    text, folder = name.strip(), "input"
    for tag in ("input", "output", "temp"):
        if text.endswith(f"[{tag}]") and tag in folders:
            text, folder = text[:-len(tag) - 2].rstrip(), tag
            break
    base = os.path.abspath(folders[folder])
    target = os.path.normpath(os.path.join(base, text))
    if (not text or os.path.isabs(text) or text.startswith("~")
            or os.path.commonpath([base, target]) != base or target == base):
        raise InputError(
            f"{name!r} is not a file name in the {folder} folder: only files inside it are "
            f"read (subfolders allowed; 'name [output]' for the output folder), never an "
            f"absolute path, '~' or '..'. Upload the file or copy it into "
            f"{folders['input']}")
    return Path(target)


class HeadlessHost:
    """Runs nodes outside ComfyUI: models from ``model_dir`` (default: ``$SEEDVR2_MODEL_DIR``,
    ComfyUI's models/SEEDVR2 when importable, else the user cache), inputs from ``input_dir``,
    outputs to ``output_dir``; a run on a ComfyUI server uploads from and downloads into these."""

    def __init__(self, model_dir=None, input_dir=".", output_dir="output", quiet: bool = False):
        if model_dir is None:
            from ..loading.registry import default_model_dir

            model_dir = default_model_dir()
        self.model_dir = Path(model_dir).expanduser()
        self.input_dir = Path(input_dir).expanduser()
        self.output_dir = Path(output_dir).expanduser()
        self.quiet = quiet
        self.stop = threading.Event()  # set to interrupt the running node
        self.saved: list[Path] = []
        self.warnings: list[str] = []
        self._bar = None
        self._temp = None  # the temporary folder of in-graph results (VIDEO files)
        self.label = ""

    def model_names(self) -> list[str]:
        if not self.model_dir.is_dir():
            return []
        return sorted(str(p.relative_to(self.model_dir)) for p in self.model_dir.rglob("*")
                      if p.is_file() and not p.name.startswith("."))

    def model_path(self, name: str) -> Optional[Path]:
        path = self.model_dir / name
        return path if path.is_file() else None

    def model_folder(self) -> Path:
        return self.model_dir

    def input_names(self) -> list[str]:
        if not self.input_dir.is_dir():
            return []
        return sorted(p.name for p in self.input_dir.iterdir() if p.is_file())

    def input_path(self, name: str) -> Path:
        return confined_input_path(name, {"input": self.input_dir, "output": self.output_dir})

    def output_file(self, prefix: str, suffix: str, width: int, height: int) -> tuple[Path, dict]:
        """The next ``<prefix>_NNNNN_<suffix>`` in the output folder, numbered as ComfyUI does."""
        prefix = prefix.replace("%width%", str(width)).replace("%height%", str(height))
        subfolder, name = os.path.split(os.path.normpath(prefix))
        folder = (self.output_dir / subfolder).resolve()
        if os.path.commonpath([self.output_dir.resolve(), folder]) != str(self.output_dir.resolve()):
            raise InputError(f"filename_prefix {prefix!r}: saving outside the output folder is "
                             f"not allowed")
        folder.mkdir(parents=True, exist_ok=True)
        pattern = re.compile(re.escape(name) + r"_(\d+)_")
        used = [int(m[1]) for p in folder.iterdir() if (m := pattern.match(p.name))]
        path = folder / f"{name}_{max(used, default=0) + 1:05}_{suffix}"
        self.saved.append(path)
        return path, {"filename": path.name, "subfolder": subfolder, "type": "output"}

    def progress(self, value: int, total: int) -> None:
        if self.quiet:
            return
        from tqdm import tqdm

        if self._bar is None or self._bar.total != total:
            self.close_bar()
            self._bar = tqdm(total=total, desc=self.label, unit="step", leave=False)
        self._bar.update(value - self._bar.n)

    def preview(self, thumbnail) -> None:
        pass  # headless: no picture to show while the job runs

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def interrupted(self) -> bool:
        return self.stop.is_set()

    def raise_interrupted(self) -> None:
        if self.stop.is_set():
            raise WorkflowInterrupted("interrupted")

    def before_load(self, model_files=(), device: str = "auto") -> None:
        pass  # nothing else holds models in this process

    def make_room(self, device: str, need: int) -> None:
        pass

    def after_run(self) -> None:
        gc.collect()
        try:
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        except ImportError:
            pass

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning(message)

    def video_file(self, video) -> Optional[Path]:
        return video.path

    def video_size(self, video) -> Optional[tuple]:
        if video.path is None:
            return (*video.images.shape[:3], True)
        from ..io import open_media

        with open_media(video.path) as reader:
            info = reader.info
        return info.frame_count, info.height, info.width, False

    def video_frames(self, video) -> tuple:
        return video_components(video)

    def file_video(self, path: Path):
        return Video(path=Path(path))

    def frames_video(self, images, audio, fps):
        return Video(images=images, fps=fps, audio=audio)

    def temp_file(self, prefix: str, suffix: str) -> Path:
        """A new name in this host's temporary folder (removed with the host)."""
        if self._temp is None:
            self._temp = tempfile.TemporaryDirectory(prefix="seedvr2_workflow_")
        folder = Path(self._temp.name) / os.path.dirname(prefix)
        folder.mkdir(parents=True, exist_ok=True)
        count = sum(1 for _ in folder.iterdir())
        return folder / f"{os.path.basename(prefix)}_{count + 1:05}_{suffix}"
