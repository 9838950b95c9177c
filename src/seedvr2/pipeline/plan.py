"""The batch plan: the single source of truth for how a video is cut into temporal batches, computed
from the frame count and the options before any frame is read (every process derives the same plan).

Timeline. ``prepend_frames`` P reversed copies of frames 1..P are put in front of the video
(temporal context for its first frames) and dropped from the output, so plan frame i is source frame
``P - i`` for i < P and ``i - P`` after.

Batches. Consecutive windows of ``batch_size`` plan frames, each starting ``temporal_overlap``
frames before the previous one ends. The VAE needs 4n+1 frames: a short last batch is padded by
repeating its last frame, to the next 4n+1 length or, with ``uniform_batch_size``, to
``batch_size``. Frames shared by two batches are cross-faded (see :func:`blend_weights`).

Shots. Scene cuts (``scene_cuts``, :mod:`.cuts`) split the video into shots, each planned as above
on its own: no batch holds frames of two shots, the first batch of a shot shares no frames with the
one before, and the prepended frames come from the first shot only.

Chunks. Batches are grouped into chunks of about ``chunk_size`` new frames; the pipeline runs encode
→ DiT → decode phase by phase over a chunk, so at most a chunk's frames are in flight."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError, UsageError
from ..options import Options


@dataclass(frozen=True)
class Batch:
    index: int
    start: int  # first plan frame
    stop: int  # one past the last plan frame
    length: int  # frames fed to the VAE: stop - start padded to 4n+1
    overlap: int  # leading frames shared with the previous batch (cross-faded)

    @property
    def frames(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BatchPlan:
    source_frames: int  # frames of the input video
    prepend: int  # reversed frames added in front
    batches: tuple[Batch, ...]
    chunks: tuple[tuple[int, ...], ...]  # batch indices per chunk
    cuts: tuple[int, ...] = ()  # scene cuts: source frames that start a shot

    @property
    def plan_frames(self) -> int:
        return self.source_frames + self.prepend

    def source_index(self, plan_frame: int) -> int:
        """Which source frame a plan frame shows."""
        return self.prepend - plan_frame if plan_frame < self.prepend else plan_frame - self.prepend

    def source_start(self, plan_frame: int) -> int:
        """First source frame that plan frames from ``plan_frame`` on can need."""
        return 0 if plan_frame <= self.prepend else plan_frame - self.prepend

    def read_start(self, batches) -> int:
        """First source frame a job of these plan batch indices (ascending) reads."""
        return self.source_start(self.batches[batches[0]].start) if len(batches) else 0

    def emit_stop(self, batch: Batch) -> int:
        """Plan frames before this index are final once ``batch`` is blended in."""
        following = batch.index + 1
        return self.batches[following].start if following < len(self.batches) else self.plan_frames


def next_4n1(n: int) -> int:
    return n + (1 - n) % 4


def make_plan(source_frames: int, opts: Options) -> BatchPlan:
    """The plan of a clip of ``source_frames``. ``opts.scene_cuts`` must be resolved (a tuple:
    :func:`~seedvr2.pipeline.cuts.resolve_scene_cuts`): each shot is planned on its own, so no
    batch, cross-fade or prepended frame crosses a cut; with no cuts, one shot is the clip."""
    if source_frames < 1:
        raise InputError("the input has no frames")
    cuts = opts.scene_cuts
    if not isinstance(cuts, tuple):
        raise UsageError(f"scene_cuts = {cuts!r} must be resolved before the batch plan is made "
                         f"(seedvr2.pipeline.cuts.resolve_scene_cuts)")
    # The prepended frames copy frames 1..P of the first shot: they stay inside it.
    prepend = min(opts.prepend_frames, (cuts[0] if cuts else source_frames) - 1)
    bounds = [0, *(c + prepend for c in cuts), source_frames + prepend]
    batches = []
    for shot_start, shot_stop in zip(bounds, bounds[1:]):
        _plan_shot(batches, shot_start, shot_stop, opts)
    chunk_frames = max(opts.chunk_size, 1)
    chunks, current, fresh = [], [], 0
    for b in batches:
        new = b.frames - b.overlap
        if current and fresh + new > chunk_frames:
            chunks.append(tuple(current))
            current, fresh = [], 0
        current.append(b.index)
        fresh += new
    chunks.append(tuple(current))
    return BatchPlan(source_frames, prepend, tuple(batches), tuple(chunks), cuts)


def _plan_shot(batches: list, start: int, total: int, opts: Options):
    """Appends the batches of plan frames [start, total): windows of ``batch_size`` overlapping
    by ``temporal_overlap``, the first with none, the last padded to 4n+1."""
    size, overlap = opts.batch_size, opts.temporal_overlap
    first = len(batches)
    while True:
        stop = min(start + size, total)
        length = size if opts.uniform_batch_size else next_4n1(stop - start)
        batches.append(Batch(len(batches), start, stop, length,
                             overlap if len(batches) > first else 0))
        if stop == total:
            return
        start += size - overlap


def blend_weights(overlap: int) -> torch.Tensor:
    """Weights of the *later* batch across an overlap of n frames (the earlier gets 1 − w): a
    raised cosine from 0 to 1 (end points excluded), linear under 3 frames (no room to differ)."""
    steps = torch.arange(1, overlap + 1, dtype=torch.float64) / (overlap + 1)
    weights = steps if overlap < 3 else 0.5 - 0.5 * torch.cos(math.pi * steps)
    return weights.float()
