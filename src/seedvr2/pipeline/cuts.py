"""Scene cuts: where one shot ends and the next begins, found before the batch plan is made.

A cut is the first frame of a new shot. The plan (:mod:`.plan`) never puts frames of two shots in
one batch, cross-fade or prepended context, so nothing of a shot leaks into the next. What a cut
is to ``auto`` (flashes, fades, ``min_scene_length``, limits) and the measurements the thresholds
sit between: docs/media.md#scene-cuts. Detection keeps only the previous frame's features
(:class:`FrameFeatures`, of a copy at most :data:`SMALL_WIDTH` pixels wide, in numpy float32), so
memory does not grow with the length."""

from __future__ import annotations

import itertools
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np

from ..io import open_media
from ..io.files import frame_count
from ..memory.device_choice import resolve_device, resolve_dtype
from ..models import build_on_meta
from ..models.config import dit_config, vae_config
from ..options import Options, OptionError, option_ref, option_value
from .plan import make_plan
from .runner import output_size, source_frame
from .work import job_work

log = logging.getLogger(__name__)

SMALL_WIDTH = 64  # pixels: enough for a shot's layout, ~1/1000 of a 1080p frame's pixels
MAX_CORRELATION = 0.5  # a cut: structure correlation under this ...
MIN_HISTOGRAM_DISTANCE = 0.15  # ... and histogram distance over this
FLAT_STD = 0.01  # grey standard deviation (0..1 scale) under which a small frame is flat
# A structured frame this faint next to a flat one is the end or start of a fade, not a cut:
# a fade over 10 frames from the test shots' 0.04-0.07 leaves 0.005-0.02 before black.
FADE_STD = 0.025
DARK = 0.05  # mean grey under which a flat frame is black: its hue is noise
MIN_FLAT_HUE_DISTANCE = 0.05  # two flat frames: L1 distance of their mean chromaticities
FLASH_FRAMES = 6  # longest flash: a camera flash or lightning lasts 1-4 frames
_BINS = 4  # histogram bins per channel
_LUMA = np.array([0.299, 0.587, 0.114], np.float32)


@dataclass(frozen=True)
class FrameFeatures:
    grey: Optional[np.ndarray]  # (h*w,) mean 0, std 1; None for a flat frame
    histogram: np.ndarray  # (64,) RGB histogram, sums to 1
    chroma: np.ndarray  # (3,) mean r, g, b over r + g + b
    std: float = 1.0  # grey standard deviation, 0..1 scale
    mean: float = 0.5  # mean grey, 0..1


def frame_features(frame, index: int = 0) -> FrameFeatures:
    """The small features of one frame (H, W, C), any precision the pipeline takes; in numpy
    on this thread (torch would split even this little work over threads)."""
    frame = source_frame(frame, index).cpu().numpy()
    height, width = frame.shape[:2]
    size = (max(1, round(height * min(width, SMALL_WIDTH) / width)), min(width, SMALL_WIDTH))
    # 4 x 4 evenly spread samples per small pixel, averaged: an area average at 1/100 of the reads.
    rows, cols = (np.linspace(0, n - 1, 4 * k).round().astype(int) for n, k in zip(
        (height, width), size))
    sample = frame[rows[:, None], cols[None, :], :3].astype(np.float32)  # alpha dropped
    if frame.dtype.kind == "u":
        sample *= np.float32(1 / np.iinfo(frame.dtype).max)
    small = sample.reshape(size[0], 4, size[1], 4, -1).mean((1, 3))  # (h, w, 1 or 3)
    small = np.broadcast_to(small, (*size, 3)).reshape(-1, 3)  # (h*w, 3)
    grey = (small * _LUMA).sum(1)  # not a matmul: BLAS would start threads for it
    std = grey.std()
    chroma = (small / (small.sum(1, keepdims=True) + 1e-6)).mean(0)
    return FrameFeatures(None if std < FLAT_STD else (grey - grey.mean()) / std,
                         _soft_histogram(small), chroma, float(std), float(grey.mean()))


def _soft_histogram(rgb: np.ndarray) -> np.ndarray:
    """(n, 3) colours in [0, 1] -> (64,) histogram, each shared trilinearly between the 8 bin
    centres around it: a colour drifting across a bin edge moves it gradually, not all at once."""
    position = np.clip(rgb, 0, 1) * (_BINS - 1)
    low = np.minimum(np.floor(position), _BINS - 2)
    frac, low = position - low, low.astype(int)
    histogram = np.zeros(_BINS ** 3)
    for corner in itertools.product((0, 1), repeat=3):
        index = (((low + corner) * (_BINS ** 2, _BINS, 1)).sum(1))
        weight = np.where(corner, frac, 1 - frac).prod(1)
        histogram += np.bincount(index, weight, _BINS ** 3)
    return histogram / len(rgb)


def is_cut(before: FrameFeatures, after: FrameFeatures) -> bool:
    """Whether ``after`` starts a new shot next to ``before``: a grey correlation (invariant to
    brightness and contrast) under :data:`MAX_CORRELATION`, a flat frame's structure differing from
    any other's, and a histogram distance (half the L1 norm) over :data:`MIN_HISTOGRAM_DISTANCE`;
    between two flat frames their mean chromaticity alone, black having no hue."""
    if before.grey is None and after.grey is None:
        if min(before.mean, after.mean) < DARK:
            return False  # black is black: the hue of a dark frame is its noise
        return float(abs(before.chroma - after.chroma).sum()) > MIN_FLAT_HUE_DISTANCE
    if before.grey is not None and after.grey is not None:
        if not _new_structure(before, after):
            return False
    elif (after if before.grey is None else before).std < FADE_STD:
        return False  # the structure fades out to a flat frame, or in from one
    return float(abs(before.histogram - after.histogram).sum()) / 2 > MIN_HISTOGRAM_DISTANCE


def _new_structure(before: FrameFeatures, after: FrameFeatures) -> bool:
    return float((before.grey * after.grey).mean()) < MAX_CORRELATION


@dataclass
class _Detection:
    """What :func:`detect_cuts` keeps: a few frames' features, not the frames."""

    min_length: int
    cuts: list  # (cut frame, the features of the frame before it)
    previous: Optional[FrameFeatures] = None
    last_structured: Optional[FrameFeatures] = None  # the last frame that was not flat

    def see(self, index: int, features: FrameFeatures) -> None:
        previous = self.previous
        if previous is not None and (is_cut(previous, features) or self._faded_to_another(
                previous, features)):
            self._add(index, previous, features)
        self.previous = features
        if features.grey is not None:
            self.last_structured = features

    def _faded_to_another(self, previous: FrameFeatures, features: FrameFeatures) -> bool:
        """A fade through a flat colour (black) into a new shot: the first frame with
        structure again has another structure than the last one before the flat frames."""
        return previous.grey is None and features.grey is not None and \
            self.last_structured is not None and _new_structure(self.last_structured, features)

    def _add(self, index: int, previous: FrameFeatures, features: FrameFeatures) -> None:
        last, before_last = self.cuts[-1] if self.cuts else (0, None)
        if index - last <= max(FLASH_FRAMES, self.min_length - 1) and \
                before_last is not None and not is_cut(before_last, features):
            self.cuts.pop()  # a flash: a short excursion back to the shot before it
        elif index - last >= self.min_length:
            self.cuts.append((index, previous))
        # else: a shot shorter than min_length; the cut before it stands


def detect_cuts(frames: Iterable, min_length: int = 1) -> tuple[int, ...]:
    """The cuts of a stream of frames, in one pass keeping a few frames' features; no flash,
    and no shot (the first included) shorter than ``min_length`` frames."""
    detection = _Detection(min_length, [])
    for index, frame in enumerate(frames):
        detection.see(index, frame_features(frame, index))
    return tuple(cut for cut, _ in detection.cuts)


def resolve_scene_cuts(opts: Options, frame_count: int,
                       frames: Callable[[], Iterable]) -> Options:
    """``opts`` with ``scene_cuts`` a tuple: given cuts checked against ``frame_count``,
    ``auto`` detected on ``frames()`` (not read for one frame)."""
    cuts = opts.scene_cuts
    if cuts == "auto":
        cuts = detect_cuts(frames(), opts.min_scene_length) if frame_count > 1 else ()
    elif cuts and cuts[-1] >= frame_count:
        raise OptionError(f"{option_value('scene_cuts', ','.join(map(str, cuts)))}: the input "
                          f"has {frame_count} frames (0 to {frame_count - 1}), so a cut at "
                          f"{cuts[-1]} is past its end; remove it or use "
                          f"{option_ref('scene_cuts', 'auto')}")
    log.info("%s", describe_cuts(cuts))
    _warn_if_prepend_shortened(opts.prepend_frames, cuts, frame_count)
    return opts.replace(scene_cuts=cuts)


def _warn_if_prepend_shortened(prepend: int, cuts: tuple, frame_count: int):
    """At most the first shot's length - 1 frames are prepended (1..P of it): say when fewer are."""
    length = cuts[0] if cuts else frame_count
    if prepend > length - 1:
        shot = f"the first shot has {length} frames (a scene cut at frame {length})" if cuts \
            else f"the input has {length} frame{'s' if length != 1 else ''}"
        warnings.warn(f"{option_value('prepend_frames', prepend)}: {shot}, so "
                      f"{length - 1} {'is' if length == 2 else 'are'} prepended", stacklevel=3)


def describe_cuts(cuts: tuple) -> str:
    """``3 scene cuts: 120, 348, 901``, ``1 scene cut: 120`` or ``no scene cuts``."""
    if not cuts:
        return "no scene cuts"
    return f"{len(cuts)} scene cut{'s' if len(cuts) > 1 else ''}: {', '.join(map(str, cuts))}"


def describe_plan(plan) -> str:
    """The plan in lines: the cuts, then each shot's batches as source frame ranges."""
    lines = [f"{plan.source_frames} frames, {describe_cuts(plan.cuts)}, "
             f"{len(plan.batches)} batches"]
    starts = {c + plan.prepend for c in plan.cuts} | {0}
    for b in plan.batches:
        first, last = plan.source_start(b.start), b.stop - 1 - plan.prepend
        if b.start in starts:
            lines.append(f"shot from frame {first}:")
        pad = f", padded to {b.length}" if b.length != b.frames else ""
        fade = f", {b.overlap} cross-faded" if b.overlap else ""
        fade += f", {plan.prepend - b.start} prepended" if b.start < plan.prepend else ""
        lines.append(f"  batch {b.index}: frames {first}-{last} ({b.frames} frames{pad}{fade})")
    return "\n".join(lines)


def describe_file_plan(src, opts: Options, family: str = "3b") -> str:
    """What ``seedvr2 upscale --dry-plan`` prints for one input, no model loaded: its scene
    cuts and batches, the work of the ``family`` DiT (3b, 7b) and its time on the device."""
    if opts.batch_size == "auto":
        raise OptionError(f"{option_value('batch_size', 'auto')} is chosen from the free memory "
                          f"once the models load: give a number to see the plan")
    with open_media(src) as reader:
        count = frame_count(reader)
        plan = make_plan(count, resolve_scene_cuts(opts, count, reader.frames))
        size = output_size(reader.info.height, reader.info.width, opts)
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    work = job_work(build_on_meta("dit", dit_config(family)), vae_config("vae"), plan, opts,
                    size, dtype)
    return f"{src}: {describe_plan(plan)}\nwork: {work.describe(str(device), dtype)}"
