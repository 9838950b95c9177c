"""Resume: a file job killed at any instant continues where it stopped when run again.

While a job runs, its output is kept as closed **segments** — consecutive runs of whole
chunks of the batch plan, each a finished file of its own — next to the output, in the hidden
folder ``.NAME.seedvr2-resume/``, together with a small **journal** (``journal.json``) naming
what the job is (options, plan, output, and the input and model files by content digest) and
the segments that are complete, and the **tail**: the last completed batch's frames that the
next batch still cross-fades with (float32, exact). Each of those is written under a
temporary name, flushed to disk and renamed, and the journal is renamed last: whatever
instant a kill -9 hits, the journal names only segments that are whole.

Running the same job again (same input, output, options, models) reads the journal, drops
anything it does not name, and computes only the batches of the missing segments; the tail
restores the blend, and every batch draws its noise from (seed, its first frame), so the
frames are those of an uninterrupted run. Anything different starts fresh, saying what
differs. ``resume=False`` (``--no-resume``) discards what was kept and starts over.

When every segment is complete the final output is assembled: videos by stream copy of the
segments' packets (no re-encoding) with the source's audio muxed in at that point; image
outputs (kept as lossless PNG segments) through the ordinary image writer. Then the folder
is removed. A job that fails or is interrupted keeps the folder when at least one segment is
complete (and says so), and removes it otherwise.

Segments start a new GOP, so they are at least :data:`SEGMENT_FRAMES` frames (whole plan
chunks); a job whose plan makes only one segment is written directly, as before.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..io.segments import SegmentConcat, sync_file
from .plan import BatchPlan

log = logging.getLogger("seedvr2")

JOURNAL_VERSION = 1
SEGMENT_FRAMES = 96  # at least this many frames per segment (each one restarts the GOP)
SEGMENT_FRAMES_ENV = "SEEDVR2_SEGMENT_FRAMES"  # tests: smaller segments on short clips
KILL_ENV = "SEEDVR2_KILL_AT"  # tests: "POINT:N" SIGKILLs the job at the N-th POINT
STATE_SUFFIX = ".seedvr2-resume"
# Options that do not change a single frame: a re-run may differ in them and still resume.
_NOT_SHAPING = {"resume", "devices", "dist_timeout", "cache_dit", "cache_vae"}


def kill_point(point: str, count: int):
    """The resume tests' kill hook: SIGKILL this process at the ``count``-th ``point``
    (``encode``/``dit``/``decode``: that batch's phase is done; ``write``: a segment has
    frames in it; ``segment``: a segment is closed but the journal does not name it yet;
    ``journal``: the journal names it)."""
    spec = os.environ.get(KILL_ENV, "")
    if spec and spec == f"{point}:{count}":
        os.kill(os.getpid(), signal.SIGKILL)


def state_folder(dst) -> Path:
    final = Path(str(dst).rstrip("/\\"))
    return final.parent / f".{final.name}{STATE_SUFFIX}"


def segment_frames() -> int:
    return int(os.environ.get(SEGMENT_FRAMES_ENV, SEGMENT_FRAMES))


@dataclass(frozen=True)
class Segment:
    number: int
    batches: tuple[int, ...]  # plan batch indices, whole chunks
    first_frame: int  # first output frame it holds
    frames: int  # output frames it holds


def emitted_through(plan: BatchPlan, batch_index: int) -> int:
    """Output frames that are final once batches 0..batch_index are blended."""
    return max(0, plan.emit_stop(plan.batches[batch_index]) - plan.prepend)


def plan_segments(plan: BatchPlan, min_frames: int) -> list[Segment]:
    """Consecutive chunks grouped until each group holds at least ``min_frames`` output
    frames (the last one takes what is left)."""
    groups: list[list[int]] = [[]]
    start = 0
    for chunk in plan.chunks:
        groups[-1].extend(chunk)
        if emitted_through(plan, chunk[-1]) - start >= min_frames:
            start = emitted_through(plan, chunk[-1])
            groups.append([])
    if not groups[-1]:
        groups.pop()
    elif len(groups) > 1 and emitted_through(plan, groups[-1][-1]) - start == 0:
        groups[-2].extend(groups.pop())  # a group that finishes no frame joins the previous one
    segments, first = [], 0
    for number, batches in enumerate(groups):
        stop = emitted_through(plan, batches[-1])
        segments.append(Segment(number, tuple(batches), first, stop - first))
        first = stop
    return segments


def _describe_difference(old: dict, new: dict) -> str:
    reasons = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key):
            continue
        if key == "options" and isinstance(old.get(key), dict):
            changed = sorted(k for k in set(old[key]) | set(new[key])
                             if old[key].get(k) != new[key].get(k))
            reasons.append("options " + ", ".join(
                f"{k} ({old[key].get(k)!r} -> {new[key].get(k)!r})" for k in changed))
        elif key in ("source", "dit", "vae", "text"):
            reasons.append(f"the {'input' if key == 'source' else key} file's content")
        else:
            reasons.append(f"{key} ({old.get(key)!r} -> {new.get(key)!r})")
    return "; ".join(reasons) or "the journal is unreadable"


def job_identity(opts, plan: BatchPlan, *, output, codec: str, size, bit_depth: int,
                 source: str, models: dict, video: bool) -> dict:
    """Everything a kept segment's frames depend on."""
    from .. import __version__

    return {
        "segment_ext": Path(str(output)).suffix.lower() if video else "/",
        "version": JOURNAL_VERSION,
        "library": __version__,
        "options": {k: v for k, v in sorted(opts.values.items()) if k not in _NOT_SHAPING},
        "plan": [[b.start, b.stop, b.length, b.overlap] for b in plan.batches],
        "chunks": [list(c) for c in plan.chunks],
        "source_frames": plan.source_frames,
        "segment_frames": segment_frames(),
        "output": str(Path(str(output)).resolve()) + ("/" if str(output).endswith(("/", os.sep)) else ""),
        "codec": codec,
        "size": list(size),
        "bit_depth": bit_depth,
        "source": source,
        **models,
    }


def _write_atomically(path: Path, data: bytes):
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


class ResumeState:
    """The journal folder of one output: what is complete, and how to continue."""

    def __init__(self, dst, identity: dict, segments: list[Segment], *, fresh: bool):
        self.folder = state_folder(dst)
        self.identity = identity
        self.segments = segments
        self.done = 0  # complete segments
        self.tail: Optional[torch.Tensor] = None
        self.note = ""  # why a kept state was not used
        journal = self._read() if self.folder.is_dir() else None
        if journal is not None and fresh:
            self.note = "resume is off: the kept segments are discarded"
            journal = None
        elif journal is not None and journal.get("identity") != identity:
            self.note = ("not resuming, starting fresh: "
                         + _describe_difference(journal.get("identity") or {}, identity)
                         + " changed since the kept segments were made")
            journal = None
        elif self.folder.is_dir() and journal is None:
            self.note = "not resuming: the kept journal is unreadable; starting fresh"
        if journal is None:
            if self.folder.exists():
                shutil.rmtree(self.folder, ignore_errors=True)
        else:
            self.done = int(journal.get("segments_done", 0))
            if self.done:
                self.tail = torch.from_numpy(np.load(self.folder / journal["tail"]))
            self._drop_unnamed(journal)
        if self.note:
            log.warning("%s (%s)", self.note, self.folder)
        self.folder.mkdir(exist_ok=True)

    def _read(self) -> Optional[dict]:
        try:
            journal = json.loads((self.folder / "journal.json").read_text())
            if journal.get("segments_done", 0) and not (self.folder / journal["tail"]).is_file():
                return None
            for segment in self.segments[: journal.get("segments_done", 0)]:
                if not self.segment_path(segment).exists():
                    return None
            return journal
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def _drop_unnamed(self, journal: dict):
        """Anything a killed run left that the journal does not name (a half-written segment,
        a tail not yet recorded) goes."""
        keep = {"journal.json", journal.get("tail")}
        keep.update(self.segment_path(s).name for s in self.segments[: self.done])
        for entry in self.folder.iterdir():
            if entry.name in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    @property
    def reused_batches(self) -> int:
        return sum(len(s.batches) for s in self.segments[: self.done])

    @property
    def remaining_batches(self) -> list[int]:
        """Plan batch indices still to compute, in order (whole chunks)."""
        return [b for s in self.segments[self.done:] for b in s.batches]

    @property
    def ext(self) -> str:
        return self.identity["segment_ext"]

    def segment_path(self, segment: Segment) -> Path:
        suffix = self.identity["segment_ext"]
        return self.folder / (f"seg-{segment.number:05d}{suffix}" if suffix != "/"
                              else f"seg-{segment.number:05d}")

    def complete(self, segment: Segment, tail: torch.Tensor):
        """Record ``segment`` as complete (its file closed) with the blend tail after it."""
        path = self.segment_path(segment)
        if path.is_dir():
            for f in path.iterdir():
                sync_file(f)
        else:
            sync_file(path)
        kill_point("segment", segment.number + 1)
        tail_name = f"tail-{segment.number:05d}.npy"
        temp = self.folder / f".{tail_name}.tmp"
        with open(temp, "wb") as f:
            np.save(f, tail.contiguous().numpy())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, self.folder / tail_name)
        journal = {"identity": self.identity, "segments_done": segment.number + 1,
                   "tail": tail_name}
        _write_atomically(self.folder / "journal.json", json.dumps(journal, indent=1).encode())
        previous = self.folder / f"tail-{segment.number - 1:05d}.npy"
        previous.unlink(missing_ok=True)
        self.done = segment.number + 1
        kill_point("journal", segment.number + 1)

    def discard(self):
        shutil.rmtree(self.folder, ignore_errors=True)

    def keep_or_discard(self, total_batches: int):
        """After a failure: keep what is complete for the next run, or leave nothing."""
        if self.done == 0:
            self.discard()
            return
        log.warning("%d of %d batches are kept in %s: run the same command again to continue "
                    "(--no-resume, or resume=False, starts over)", self.reused_batches,
                    total_batches, self.folder)


def open_resume_state(reader, dst, opts, plan: BatchPlan, size, bit_depth: int, codec: str,
                      dit, vae, model_dir, compute_dtype: torch.dtype) -> Optional[ResumeState]:
    """The resume journal of this job, or None when the job is written directly: a plan of
    one segment, a single image, or a video made from images without a rate. ``opts`` are
    the job's options as the caller gave them (one process or several: the same journal),
    models are named by content whether given loaded or by file, and ``compute_dtype`` is
    the precision ``dtype`` resolved to on this device (``auto`` differs between GPUs)."""
    from ..loading.registry import DEFAULT_DIT, DEFAULT_VAE, resolve_model_file
    from .identity import model_digest, source_digest
    from .setup import VIDEO_SUFFIXES

    segments = plan_segments(plan, segment_frames())
    video = Path(str(dst)).suffix.lower() in VIDEO_SUFFIXES
    info = reader.info
    # Images without a rate into a video (the rate comes from ``fps``) are written directly.
    if len(segments) < 2 or video and info.fps is None:
        if not opts.resume:
            shutil.rmtree(state_folder(dst), ignore_errors=True)
        return None
    models = {"compute_dtype": str(compute_dtype)}
    for kind, spec, default in (("dit", dit, DEFAULT_DIT), ("vae", vae, DEFAULT_VAE)):
        if isinstance(spec, torch.nn.Module):  # loaded by the caller (the CLI, once per run)
            source_file = getattr(spec, "weights_file", None)
            models[kind] = model_digest(source_file) if source_file else _module_digest(spec)
        else:
            models[kind] = model_digest(resolve_model_file(spec or default, model_dir, kind))
    text = Path(str(opts.text_embeddings))
    models["text"] = model_digest(text) if text.is_file() else str(opts.text_embeddings)
    identity = job_identity(opts, plan, output=dst, codec=codec, size=size, bit_depth=bit_depth,
                            source=source_digest(reader), models=models, video=video)
    return ResumeState(dst, identity, segments, fresh=not opts.resume)


def _module_digest(module: torch.nn.Module) -> str:
    """A loaded model's weights by content (the CLI passes its once-loaded models)."""
    import hashlib

    whole = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        whole.update(name.encode())
        whole.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                     if tensor.numel() else b"")
    return whole.hexdigest()


def install_kill_hook(upscaler):
    """The resume tests' kill points inside the upscaler's phases (``SEEDVR2_KILL_AT``)."""
    if not os.environ.get(KILL_ENV):
        return
    report = upscaler.progress

    def progress(phase: str, done: int, total: int):
        kill_point(phase, done)
        report(phase, done, total)
    upscaler.progress = progress


def run_resumable(compute, dst, plan: BatchPlan, state: ResumeState, *, info, size,
                  bit_depth: int, codec: str, overwrite: bool, progress, stats=None,
                  fps="auto"):
    """Upscale ``plan`` into ``dst`` through segments kept in ``state``; returns the final path.

    ``compute(batches)`` yields ``(batch, frames)`` for the given plan batch indices, in
    order: this process's upscaler, or the writer rank's gathering of every rank's batches.
    ``progress(phase, done, total)`` is told the finished frames."""
    from ..io import open_writer
    from ..io.writer import carried_streams
    from .runner import OverlapBlender, to_integer_frames
    from .setup import open_output

    segments = state.segments
    blender = OverlapBlender(plan)
    remaining = state.remaining_batches
    if state.done:
        blender.pending = state.tail
        blender.emitted = segments[state.done - 1].first_frame + segments[state.done - 1].frames
        log.info("resuming: %d of %d batches are kept in %s; computing the other %d",
                 state.reused_batches, len(plan.batches), state.folder, len(remaining))
    if stats is not None:
        stats.batches_reused = state.reused_batches
        stats.batches_total = len(plan.batches)
    video = state.ext != "/"
    try:
        if remaining:
            outputs = iter(compute(remaining))
            for segment in segments[state.done:]:
                _write_segment(segment, outputs, blender, state, info=info, size=size,
                               bit_depth=bit_depth, codec=codec, video=video,
                               open_writer=open_writer, to_integer=to_integer_frames,
                               progress=progress or (lambda phase, done, total: None))
        if stats is not None:
            stats.frames = plan.source_frames
        if video:
            carried, subtitles = carried_streams(info, Path(str(dst)).suffix.lower())
            final = SegmentConcat(dst, [state.segment_path(s) for s in segments],
                                  [s.frames for s in segments], fps=info.fps, width=size[1],
                                  height=size[0], channels=info.channels, bit_depth=bit_depth,
                                  audio_from=carried, subtitle_streams=[i for i, _ in subtitles],
                                  frame_times=info.frame_times, rotation=info.rotation,
                                  overwrite=overwrite)
            final.close()
            path = final.path
        else:
            with open_output(info, dst, size, bit_depth, codec, overwrite, fps) as writer:
                for s in segments:
                    writer.write_many(_read_pngs(state.segment_path(s)))
            path = writer.path
    except BaseException:
        state.keep_or_discard(len(plan.batches))
        raise
    state.discard()
    return Path(path)


def _read_pngs(folder: Path):
    from ..io import open_media

    with open_media(folder) as media:
        yield from media.frames()


def _write_segment(segment: Segment, outputs, blender, state: ResumeState, *, info, size,
                   bit_depth, codec, video: bool, open_writer, to_integer, progress):
    path = state.segment_path(segment)
    target = str(path) if video else f"{path}/"
    channels = info.channels
    # Image segments stay as stored: the final writer turns them upright (rotation, pixel
    # aspect) when it reads them back; video segments carry the tags either way.
    kwargs = dict(like=info, width=size[1], height=size[0], channels=channels,
                  bit_depth=bit_depth, overwrite=True, upright=False)
    if video:
        kwargs.update(codec=codec)
        if info.frame_times:  # variable rate: this segment's frames at their own times
            first = info.frame_times[segment.first_frame]
            kwargs.update(frame_times=[t - first for t in info.frame_times[
                segment.first_frame: segment.first_frame + segment.frames]])
    written = 0
    with warnings.catch_warnings():
        # A segment carries no audio or subtitles by design (the assembly adds the audio);
        # what the final output cannot hold was said when it was checked at the start.
        warnings.simplefilter("ignore", UserWarning)
        writer = open_writer(target, **kwargs)
    with writer:
        for expected in segment.batches:
            batch, out = next(outputs)
            assert batch.index == expected, (batch.index, expected)
            for _, final in blender.add(batch, out):
                writer.write_many(to_integer(final, bit_depth))
                written += len(final)
                kill_point("write", segment.number + 1)
                progress("frames", blender.emitted, blender.plan.source_frames)
    assert written == segment.frames, (written, segment.frames)
    state.complete(segment, blender.pending)
