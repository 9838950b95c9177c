"""Scene cuts: where one shot ends and the next begins, found before the batch plan is made.

A cut is the first frame of a new shot. The plan (:mod:`.plan`) never puts frames of two shots
in one batch, cross-fade or prepended context, so nothing of a shot leaks into the next.

Detection compares each frame with the one before on a small copy (area average to at most
:data:`SMALL_WIDTH` pixels wide, in float32 on the CPU, of every 7th pixel of a 1080p frame);
only the previous frame's features are kept, so memory does not grow with the length. A cut
needs two measures to agree:

* structure: the correlation of the two small grey frames, each normalised to mean 0 and
  standard deviation 1. A brightness or contrast step leaves it at ~1 (it is invariant to
  either), a slow pan keeps it high (neighbouring pixels of a small frame are alike); a new
  shot drops it to about 0.
* colour: the distance (half the L1 norm, 0..1) between the frames' RGB histograms
  (4 x 4 x 4 bins, each colour shared between the bins around it). Fast motion in one scene
  changes the structure but keeps the colours.

A flat frame (no structure: grey standard deviation under :data:`FLAT_STD`) counts as changed
structure next to any other frame. Between two flat frames colour alone can decide, and it is
their mean chromaticity (r, g, b over r + g + b) that is compared: the same colour brighter or
darker is the same shot, another hue is a new one. Limits: a cut between two shots of the
same colours and layout, and a cross-fade (no single frame changes enough), are not found; give
those cuts by hand (``scene_cuts=120,348``).

The thresholds were chosen on the clips of tests/test_scene_cuts.py (small frames of smooth
random patterns, each shot its own palette, and flat colours) and the suite's test clip:
hard cuts gave correlations of -0.1 to 0.1 and histogram distances of 0.25 to 1; pans of
2 px a frame correlations over 0.9 (histogram distance under 0.02); brightness steps (x1.6,
clipping highlights) over 0.84 and contrast steps ~1.0, with histogram distances up to 0.9;
a thin line moving fast over a slowly brightening frame a correlation of 0.08 but a
histogram distance of 0.05. Both thresholds sit inside those gaps.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from ..options import Options, OptionError, option_ref, option_value
from .runner import source_frame, unit_float

log = logging.getLogger(__name__)

SMALL_WIDTH = 64  # pixels: enough for a shot's layout, ~1/1000 of a 1080p frame's pixels
MAX_CORRELATION = 0.5  # a cut: structure correlation under this ...
MIN_HISTOGRAM_DISTANCE = 0.15  # ... and histogram distance over this
FLAT_STD = 0.01  # grey standard deviation (0..1 scale) under which a small frame is flat
MIN_FLAT_HUE_DISTANCE = 0.05  # two flat frames: L1 distance of their mean chromaticities
_BINS = 4  # histogram bins per channel
_LUMA = torch.tensor([0.299, 0.587, 0.114])


@dataclass(frozen=True)
class FrameFeatures:
    grey: Optional[torch.Tensor]  # (h*w,) mean 0, std 1; None for a flat frame
    histogram: torch.Tensor  # (64,) RGB histogram, sums to 1
    chroma: torch.Tensor  # (3,) mean r, g, b over r + g + b


def frame_features(frame, index: int = 0) -> FrameFeatures:
    """The small features of one frame (H, W, C), any precision the pipeline takes."""
    frame = source_frame(frame, index)
    # Every step-th pixel of every step-th row: each small pixel still averages >= 4 x 4
    # samples, and a 1080p frame costs 1/49 of the reads and conversions.
    step = max(1, frame.shape[1] // (SMALL_WIDTH * 4))
    rgb = unit_float(frame[::step, ::step, :3])  # alpha dropped
    if rgb.shape[-1] == 1:
        rgb = rgb.expand(-1, -1, 3)
    height, width = rgb.shape[:2]
    size = (max(1, round(height * min(width, SMALL_WIDTH) / width)), min(width, SMALL_WIDTH))
    small = F.adaptive_avg_pool2d(rgb.permute(2, 0, 1)[None], size)[0].reshape(3, -1)  # (3, h*w)
    grey = _LUMA @ small
    std = grey.std(unbiased=False)
    histogram = _soft_histogram(small)
    totals = small.sum(0) + 1e-6
    chroma = (small / totals).mean(1)
    return FrameFeatures(None if std < FLAT_STD else (grey - grey.mean()) / std, histogram,
                         chroma)


def _soft_histogram(rgb: torch.Tensor) -> torch.Tensor:
    """(3, n) colours in [0, 1] -> (64,) histogram, each colour shared between the 8 bin
    centres around it (trilinear): a colour drifting across a bin edge moves the histogram
    by as much as it drifts, not all at once."""
    position = rgb.clamp(0, 1) * (_BINS - 1)
    low = position.floor().clamp(max=_BINS - 2)
    frac, low = position - low, low.long()
    histogram = torch.zeros(_BINS ** 3)
    for corner in itertools.product((0, 1), repeat=3):
        index = ((low[0] + corner[0]) * _BINS + low[1] + corner[1]) * _BINS + low[2] + corner[2]
        weight = torch.stack([frac[c] if up else 1 - frac[c] for c, up in enumerate(corner)])
        histogram.index_add_(0, index, weight.prod(0))
    return histogram / rgb.shape[1]


def is_cut(before: FrameFeatures, after: FrameFeatures) -> bool:
    """Whether ``after`` starts a new shot (see the module's description)."""
    if before.grey is None and after.grey is None:
        return float((before.chroma - after.chroma).abs().sum()) > MIN_FLAT_HUE_DISTANCE
    if before.grey is not None and after.grey is not None:
        if float((before.grey * after.grey).mean()) >= MAX_CORRELATION:
            return False
    return float((before.histogram - after.histogram).abs().sum()) / 2 > MIN_HISTOGRAM_DISTANCE


def detect_cuts(frames: Iterable) -> tuple[int, ...]:
    """The cuts of a stream of frames, in one pass keeping one frame's features."""
    cuts, previous = [], None
    for index, frame in enumerate(frames):
        features = frame_features(frame, index)
        if previous is not None and is_cut(previous, features):
            cuts.append(index)
        previous = features
    return tuple(cuts)


def resolve_scene_cuts(opts: Options, frame_count: int,
                       frames: Callable[[], Iterable]) -> Options:
    """``opts`` with ``scene_cuts`` a tuple of cut frames: given ones checked against the
    clip's ``frame_count``; ``auto`` detected on ``frames()`` (not read for one frame, nor
    for given cuts)."""
    cuts = opts.scene_cuts
    if cuts == "auto":
        cuts = detect_cuts(frames()) if frame_count > 1 else ()
    elif cuts and cuts[-1] >= frame_count:
        raise OptionError(f"{option_value('scene_cuts', ','.join(map(str, cuts)))}: the input "
                          f"has {frame_count} frames (0 to {frame_count - 1}), so a cut at "
                          f"{cuts[-1]} is past its end; remove it or use "
                          f"{option_ref('scene_cuts', 'auto')}")
    log.info("%s", describe_cuts(cuts))
    return opts.replace(scene_cuts=cuts)


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


def describe_file_plan(src, opts: Options) -> str:
    """What ``seedvr2 upscale --dry-plan`` prints for one input: its scene cuts (resolved as a
    job would) and batches, without loading a model."""
    from ..io import open_media
    from .plan import make_plan
    from .setup import frame_count

    if opts.batch_size == "auto":
        raise OptionError(f"{option_value('batch_size', 'auto')} is chosen from the free memory "
                          f"once the models load: give a number to see the plan")
    with open_media(src) as reader:
        count = frame_count(reader)
        plan = make_plan(count, resolve_scene_cuts(opts, count, reader.frames))
    return f"{src}: {describe_plan(plan)}"
