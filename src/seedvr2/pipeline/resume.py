"""Resume: a file job killed at any instant continues where it stopped when run again.

The output is kept beside it, in ``.NAME.seedvr2-resume/``, as closed pieces (segments of
whole plan chunks, parts of the segment being written), the blend tail and a journal naming
each with its SHA-256; the same job run again verifies them and computes only what is
missing, so the file is that of an uninterrupted run. How, and its limits: docs/resume.md."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import os
import shutil
import socket
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ..errors import SeedVR2Error
from ..io import MediaError, OutputSpec, open_media, open_writer
from ..io.segments import SegmentConcat, sync_file
from ..io.temporaries import RESUME_JOURNAL, lock_folder, resume_folder
from ..faults import NO_FAULTS, Faults
from ..version import __version__
from ..loading.registry import sha256_of
from .identity import files_digest
from .plan import BatchPlan
from .runner import OverlapBlender, to_integer_frames

log = logging.getLogger("seedvr2")

JOURNAL_VERSION = 3  # 3: the job's identity is the one the ranks agree on (identity.py)
SEGMENT_FRAMES = 96  # at least this many frames per segment (each one restarts the GOP)
CHECKPOINT_SECONDS = 60.0  # a part closes at the first chunk end after this much work
JOURNAL, OWNER = RESUME_JOURNAL, "owner.json"


class ResumeFolderInUse(SeedVR2Error, RuntimeError):
    """Another live job holds the resume folder of the same output."""


@dataclass(frozen=True)
class Segment:
    number: int
    batches: tuple[int, ...]  # plan batch indices, whole chunks
    first_frame: int  # first output frame it holds
    frames: int  # output frames it holds


@dataclass(frozen=True)
class Piece:
    """A closed file (or folder) of the state folder, as the journal names it: a whole
    segment, or a part of the segment being written (``shape``: its raw frames' H, W, C)."""

    name: str
    segment: int
    first_batch: int
    last_batch: int
    first_frame: int
    frames: int
    sha256: str
    shape: Optional[tuple[int, int, int]] = None

    def entry(self) -> dict:
        entry = {"name": self.name, "segment": self.segment,
                 "batches": [self.first_batch, self.last_batch],
                 "first_frame": self.first_frame, "frames": self.frames, "sha256": self.sha256}
        if self.shape is not None:
            entry["shape"] = list(self.shape)
        return entry

    @classmethod
    def from_entry(cls, entry: dict) -> "Piece":
        shape = entry.get("shape")
        return cls(str(entry["name"]), int(entry["segment"]), int(entry["batches"][0]),
                   int(entry["batches"][1]), int(entry["first_frame"]), int(entry["frames"]),
                   str(entry["sha256"]), tuple(int(n) for n in shape) if shape else None)


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
    options_changed = old.get("options") != new.get("options")
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key) or options_changed and key in ("plan", "chunks"):
            continue  # a plan follows from the options (scene_cuts, batch_size): name those
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


def _journal_identity(identity: dict, plan: BatchPlan, output, compute_dtype: torch.dtype,
                      segment_frames: int) -> dict:
    """Everything a kept piece's frames and bytes depend on: the job's identity, its plan and
    its output (not the checkpoint interval: parts hold exact frames wherever they end)."""
    dst = str(output.dst)
    return {
        "segment_ext": Path(dst).suffix.lower() if output.is_video else "/",
        "version": JOURNAL_VERSION,
        "library": __version__,
        **identity,
        "compute_dtype": str(compute_dtype),
        "plan": [[b.start, b.stop, b.length, b.overlap] for b in plan.batches],
        "chunks": [list(c) for c in plan.chunks],
        "source_frames": plan.source_frames,
        "segment_frames": segment_frames,
        "output": str(Path(dst).resolve()) + ("/" if dst.endswith(("/", os.sep)) else ""),
        "codec": output.codec,
        "size": list(output.size),
        "bit_depth": output.bit_depth,
    }


def _write_atomically(path: Path, data: bytes):
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_bytes(data)
    sync_file(temp)
    os.replace(temp, path)


def content_digest(path: Path) -> str:
    """SHA-256 of a closed piece: a file's bytes, or a folder's files (names and bytes, in
    name order); OSError when it cannot be read as what it was. Never :mod:`.identity`'s
    cached digest: a piece damaged in place may keep its size and modification time."""
    if not path.is_dir():
        return sha256_of(path)
    return files_digest(sorted(path.iterdir()), sha256_of)


def _problem(path: Path, sha256: str) -> Optional[str]:
    """Why the closed piece at ``path`` cannot be used; None when its content is as recorded."""
    if not path.exists():
        return "is missing"
    try:
        digest = content_digest(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None if digest == sha256 else \
        "differs from the SHA-256 the journal recorded when it was closed (damaged or changed)"


class _Part:
    """The raw frames of the segment being written since the last closed piece, hashed as
    they are appended: closing it needs no second read."""

    def __init__(self, folder: Path, segment: Segment, first_batch: int, first_frame: int):
        self.name = f"part-{first_batch:06d}.raw"
        self.temp = folder / f".{self.name}.tmp"
        self.segment, self.first_batch, self.first_frame = segment, first_batch, first_frame
        self.frames, self.shape = 0, None
        self.digest = hashlib.sha256()
        self.file = open(self.temp, "wb")

    def write(self, frames: np.ndarray):
        frames = np.ascontiguousarray(frames)
        self.shape = tuple(frames.shape[1:])
        data = frames.tobytes()
        self.file.write(data)
        self.digest.update(data)
        self.frames += len(frames)

    def close(self, last_batch: int) -> Piece:
        self.file.close()
        sync_file(self.temp)
        os.replace(self.temp, self.temp.with_name(self.name))
        return Piece(self.name, self.segment.number, self.first_batch, last_batch,
                     self.first_frame, self.frames, self.digest.hexdigest(), self.shape)

    def discard(self):
        self.file.close()
        self.temp.unlink(missing_ok=True)


class ResumeState:
    """The locked state folder of one output: what is complete and verified, and how to go on."""

    def __init__(self, dst, identity: dict, plan: BatchPlan, segments: list[Segment], *,
                 fresh: bool, dtype: np.dtype, faults: Faults = NO_FAULTS):
        self.folder = resume_folder(dst)
        self.identity, self.plan, self.segments, self.dtype = identity, plan, segments, dtype
        self.faults = faults
        self.pieces: list[Piece] = []  # closed and verified, in order
        self.tail: Optional[torch.Tensor] = None  # the blend state after the last piece
        self.context: tuple[int, ...] = ()  # a chunk computed again only for its tail
        self.note = ""  # why a kept state was not used
        self.parts_closed = 0
        self._lock = self._take(dst)
        try:
            self._open(fresh)
        except BaseException:
            self.release()
            raise

    def _open(self, fresh: bool):
        journal = self._read()
        if journal is not None and fresh:
            self.note = "resume is off: the kept segments are discarded"
            journal = None
        elif journal is not None and journal.get("identity") != self.identity:
            self.note = ("not resuming, starting fresh: "
                         + _describe_difference(journal.get("identity") or {}, self.identity)
                         + " changed since the kept segments were made")
            journal = None
        if self.note:
            log.warning("%s (%s)", self.note, self.folder)
        if journal is not None:
            self._verify(journal)
        self._drop_unnamed()
        self._write_owner()
        self.last_checkpoint = time.monotonic()

    def _take(self, dst):
        if self.folder.exists() and not self.folder.is_dir():
            self.folder.unlink()
        try:
            return lock_folder(self.folder)
        except BlockingIOError:
            raise ResumeFolderInUse(
                f"another job is writing {dst}{self._owner_text()}: its resume folder "
                f"{self.folder} is in use. Wait for it to finish (or stop it), or choose "
                f"another output name") from None

    def _owner_text(self) -> str:
        try:
            owner = json.loads((self.folder / OWNER).read_text())
            return (f" (process {owner['pid']} on {owner['host']}, started {owner['started']}: "
                    f"{owner['command']})")
        except (OSError, ValueError, KeyError, TypeError):
            return ""

    def _write_owner(self):
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "command": " ".join(sys.argv)}
        _write_atomically(self.folder / OWNER, json.dumps(owner).encode())

    def _read(self) -> Optional[dict]:
        path = self.folder / JOURNAL
        if not path.exists():
            return None
        try:
            journal = json.loads(path.read_text())
            [Piece.from_entry(e) for e in journal["pieces"]]
            return journal
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            self.note = "not resuming: the kept journal is unreadable; starting fresh"
            return None

    def _verify(self, journal: dict):
        """Keep the pieces whose content is the one recorded, up to the first that is not;
        each one that fails is named, and computed again with everything after it."""
        pieces = [Piece.from_entry(e) for e in journal["pieces"]]
        good = True
        for piece in pieces:
            problem = _problem(self.folder / piece.name, piece.sha256)
            if problem:
                log.warning("resume: %s in %s %s; it is computed again", piece.name,
                            self.folder, problem)
                good = False
            elif good:
                self.pieces.append(piece)
        if not self.pieces:
            return
        tail = journal.get("tail") if isinstance(journal.get("tail"), dict) else {}
        if self.next_batch == len(self.plan.batches):
            return  # every batch is kept: no blend to continue
        if len(self.pieces) == len(pieces):
            self.tail = self._load_tail(tail)
        if self.tail is None:
            self._context_for_tail()
            # The journal names only what is kept, so a kill now does not report it again.
            self._write_journal(None)

    def _load_tail(self, tail: dict) -> Optional[torch.Tensor]:
        """The blend tail, read once and verified from the bytes held (never read again)."""
        name = str(tail.get("name", ""))
        try:
            data = (self.folder / name).read_bytes() if name else b""
            if hashlib.sha256(data).hexdigest() != tail.get("sha256"):
                raise MediaError("differs from the SHA-256 the journal recorded")
            return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
        except (OSError, ValueError) as e:
            log.warning("resume: the blend tail %s in %s cannot be used (%s); the last kept "
                        "chunk is computed again for it", name or "(none)", self.folder,
                        getattr(e, "strerror", None) or e)
            return None

    def _context_for_tail(self):
        """The blend tail after the last good piece (its last batch's own frames) comes from
        computing that chunk again, unless the batch's blended head reaches into it."""
        plan = self.plan
        last = plan.batches[self.pieces[-1].last_batch]
        chunk = next(c for c in plan.chunks if last.index in c)
        if plan.emit_stop(last) - last.start >= last.overlap:
            self.context = chunk
            return
        log.warning("resume: the blend state after %s cannot be restored (temporal_overlap "
                    "is more than half of batch_size); starting fresh", self.pieces[-1].name)
        self.pieces = []

    def _drop_unnamed(self):
        """Anything a killed run left that is not a good piece (half-written, damaged, a tail
        not yet recorded) goes."""
        keep = {JOURNAL, OWNER, *(p.name for p in self.pieces)}
        if self.tail is not None:
            keep.add(self._tail_name)
        for entry in self.folder.iterdir():
            if entry.name in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if not self.pieces:
            (self.folder / JOURNAL).unlink(missing_ok=True)

    @property
    def _tail_name(self) -> str:
        return f"tail-{self.pieces[-1].last_batch:06d}.npy" if self.pieces else ""

    @property
    def next_batch(self) -> int:
        return self.pieces[-1].last_batch + 1 if self.pieces else 0

    @property
    def next_frame(self) -> int:
        return self.pieces[-1].first_frame + self.pieces[-1].frames if self.pieces else 0

    @property
    def reused_batches(self) -> int:
        return self.next_batch - len(self.context)

    @property
    def remaining_batches(self) -> list[int]:
        """Batches still to compute (whole chunks), a chunk recomputed for its blend tail first."""
        return [*self.context, *range(self.next_batch, len(self.plan.batches))]

    @property
    def open_segment(self) -> int:
        """The segment the next batch belongs to."""
        after = self.next_batch
        return next((s.number for s in self.segments if after in s.batches), len(self.segments))

    def parts_of(self, segment: Segment) -> list[Piece]:
        return [p for p in self.pieces if p.shape is not None and p.segment == segment.number]

    @property
    def ext(self) -> str:
        return self.identity["segment_ext"]

    def segment_path(self, segment: Segment) -> Path:
        name = f"seg-{segment.number:05d}"
        return self.folder / (name if self.ext == "/" else name + self.ext)

    def checkpoint_due(self) -> bool:
        interval = self.faults.checkpoint_seconds
        return time.monotonic() - self.last_checkpoint >= (
            CHECKPOINT_SECONDS if interval is None else interval)

    def close_part(self, part: _Part, last_batch: int, tail: torch.Tensor):
        """Record the part's frames (the segment's frames so far) as kept."""
        self._record(part.close(last_batch), tail)
        self.parts_closed += 1
        self.faults.kill_point("part", self.parts_closed)

    def complete(self, segment: Segment, tail: torch.Tensor):
        """Record ``segment`` as complete with the blend tail after it; its parts go."""
        path = self.segment_path(segment)
        for f in path.iterdir() if path.is_dir() else [path]:
            sync_file(f)
        self.faults.kill_point("segment", segment.number + 1)
        piece = Piece(path.name, segment.number, segment.batches[0], segment.batches[-1],
                      segment.first_frame, segment.frames, content_digest(path))
        parts = self.parts_of(segment)
        self._record(piece, tail, replacing=parts)
        for part in parts:
            (self.folder / part.name).unlink(missing_ok=True)
        self.faults.kill_point("journal", segment.number + 1)

    def _record(self, piece: Piece, tail: torch.Tensor, replacing=()):
        old_tail = self._tail_name
        self.pieces = [p for p in self.pieces if p not in replacing] + [piece]
        buffer = io.BytesIO()
        np.save(buffer, tail.detach().cpu().contiguous().numpy(), allow_pickle=False)
        data = buffer.getvalue()
        _write_atomically(self.folder / self._tail_name, data)
        self._write_journal({"name": self._tail_name,
                             "sha256": hashlib.sha256(data).hexdigest()})
        if old_tail and old_tail != self._tail_name:
            (self.folder / old_tail).unlink(missing_ok=True)
        self.last_checkpoint = time.monotonic()

    def _write_journal(self, tail: Optional[dict]):
        journal = {"identity": self.identity, "pieces": [p.entry() for p in self.pieces],
                   "tail": tail}
        _write_atomically(self.folder / JOURNAL, json.dumps(journal, indent=1).encode())

    def read_part(self, part: Piece):
        """The part's frames, hashed as read: a change since verification fails before closing."""
        shape = part.shape
        frame_bytes = int(np.prod(shape)) * self.dtype.itemsize
        digest = hashlib.sha256()
        with open(self.folder / part.name, "rb") as f:
            for _ in range(part.frames):
                data = f.read(frame_bytes)
                digest.update(data)
                if len(data) < frame_bytes:
                    break
                yield np.frombuffer(data, self.dtype).reshape(shape)[None]
            digest.update(f.read())
        if digest.hexdigest() != part.sha256:
            raise MediaError(self._changed(part.name))

    def _changed(self, name: str) -> str:
        return (f"{name} in {self.folder} changed since it was checked; run the same command "
                f"again: it is computed again")

    def verify_segments(self):
        """Right before the assembly: every segment is still the one recorded."""
        for piece in self.pieces:
            if _problem(self.folder / piece.name, piece.sha256):
                raise MediaError(self._changed(piece.name))

    def release(self):
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def discard(self):
        shutil.rmtree(self.folder, ignore_errors=True)
        self.release()

    def keep_or_discard(self, total_batches: int):
        """After a failure: keep what is complete for the next run, or leave nothing."""
        if not self.pieces:
            self.discard()
            return
        self.release()
        log.warning("%d of %d batches are kept in %s: run the same command again to continue "
                    "(--no-resume, or resume=False, starts over)", self.reused_batches,
                    total_batches, self.folder)


def open_resume_state(reader, output, plan: BatchPlan, identity: dict,
                      compute_dtype: torch.dtype, *, fresh: bool,
                      faults: Faults = NO_FAULTS) -> Optional[ResumeState]:
    """The resume journal of this job; None when it is written directly (a plan of one chunk,
    or a video from images without a rate). ``identity``: :func:`.identity.job_identity`;
    ``compute_dtype``: ``dtype`` as resolved on this device (``auto`` differs between GPUs);
    ``fresh`` discards what was kept. :class:`ResumeFolderInUse` while another job writes it."""
    if len(plan.chunks) < 2 or output.is_video and reader.info.fps is None:
        return None
    frames = SEGMENT_FRAMES if faults.segment_frames is None else faults.segment_frames
    return ResumeState(output.dst, _journal_identity(identity, plan, output, compute_dtype, frames),
                       plan, plan_segments(plan, frames), fresh=fresh,
                       dtype=np.dtype(np.uint16 if output.bit_depth == 16 else np.uint8),
                       faults=faults)


def run_resumable(compute, state: ResumeState, info, output, progress=None, stats=None,
                  preview=None) -> Path:
    """Upscale ``state.plan`` into ``output`` through pieces kept in ``state``; returns the
    final path. ``compute(batches)`` yields ``(batch, frames)`` of those plan batches in order
    (this process's upscaler, or the writer rank's gathering); ``progress``, ``preview`` and
    ``stats`` are told the finished frames (``stats`` also the batches reused)."""
    plan = state.plan
    if state.pieces:
        log.info("resuming: %d of %d batches are kept in %s; computing the other %d",
                 state.reused_batches, len(plan.batches), state.folder,
                 len(plan.batches) - state.reused_batches)
    if stats is not None:
        stats.batches_reused, stats.batches_total = state.reused_batches, len(plan.batches)
    try:
        remaining = state.remaining_batches
        outputs = iter(compute(remaining)) if remaining else iter(())
        blender = _restored_blender(state, outputs)
        def frames_done(done: int, total: int, newest):
            if progress is not None:
                progress("frames", done, total)
            if preview is not None:
                preview(newest)
        for segment in state.segments[state.open_segment:]:
            _write_segment(segment, outputs, blender, state, info, output, frames_done)
        # Every batch is taken: this runs the producer to its end (the ranks' summary).
        leftover = next(outputs, None)
        assert leftover is None, leftover
        if stats is not None:
            stats.frames = plan.source_frames
        state.verify_segments()
        path = _assemble(state, info, output)
    except BaseException:
        state.keep_or_discard(len(plan.batches))
        raise
    state.discard()
    return Path(path)


def _restored_blender(state: ResumeState, outputs):
    """The blend state after the last kept piece: its tail, or its chunk again from ``outputs``."""
    blender = OverlapBlender(state.plan)
    for expected in state.context:  # computed again for its blend tail only
        batch, out = next(outputs)
        assert batch.index == expected, (batch.index, expected)
        for _ in blender.add(batch, out):
            pass
    if state.tail is not None:
        blender.pending = state.tail
    blender.emitted = state.next_frame
    return blender


def _assemble(state: ResumeState, info, output):
    """The final output's path, from the complete segments: a video by stream copy with the
    source's audio muxed in, images through the ordinary image writer."""
    segments, size = state.segments, output.size
    if state.ext == "/":
        with output.open(info) as writer:
            for s in segments:
                with open_media(state.segment_path(s)) as pngs:
                    writer.write_many(pngs.frames())
        return writer.path
    spec = OutputSpec(width=size[1], height=size[0], bit_depth=output.bit_depth,
                      audio_from=info).resolved(Path(str(output.dst)), info)
    final = SegmentConcat(output.dst, [state.segment_path(s) for s in segments],
                          [s.frames for s in segments], spec, overwrite=output.overwrite,
                          after_segment=state.faults.assembled)
    final.close()
    return final.path


def _segment_writer(segment: Segment, state: ResumeState, info, output):
    """The writer of one segment file (video) or folder (lossless PNGs)."""
    path, video = state.segment_path(segment), state.ext != "/"
    # Image segments stay as stored (the final writer turns them upright); video ones carry tags.
    times = None
    if video and info.frame_times:  # variable rate: this segment's frames at their own times
        first = info.frame_times[segment.first_frame]
        times = tuple(t - first for t in info.frame_times[
            segment.first_frame: segment.first_frame + segment.frames])
    spec = OutputSpec(width=output.size[1], height=output.size[0], channels=info.channels,
                      bit_depth=output.bit_depth, codec=output.codec, frame_times=times,
                      upright=False)
    with warnings.catch_warnings():
        # Segments hold no audio or subtitles (added at assembly, or warned of at the start).
        warnings.simplefilter("ignore", UserWarning)
        return open_writer(str(path) if video else f"{path}/", spec, like=info, overwrite=True)


def _write_segment(segment: Segment, outputs, blender, state: ResumeState, info, output,
                   frames_done):
    """Write ``segment``: its kept parts' frames, then its other chunks', closing a part at a
    chunk's end when a checkpoint is due; ``frames_done(done, total, newest)`` after each."""
    written = 0
    writer = _segment_writer(segment, state, info, output)
    first_batch = max(segment.batches[0], state.next_batch)
    chunks = [c for c in blender.plan.chunks if c[0] in segment.batches and c[0] >= first_batch]
    part = _Part(state.folder, segment, first_batch, blender.emitted)
    try:
        with writer:
            for kept in state.parts_of(segment):
                for frames in state.read_part(kept):
                    writer.write_many(frames)
                    written += len(frames)
            for number, chunk in enumerate(chunks):
                for expected in chunk:
                    batch, out = next(outputs)
                    assert batch.index == expected, (batch.index, expected)
                    for _, final in blender.add(batch, out):
                        frames = to_integer_frames(final, output.bit_depth)
                        writer.write_many(frames)
                        part.write(frames)
                        written += len(final)
                        state.faults.kill_point("write", segment.number + 1)
                        frames_done(blender.emitted, blender.plan.source_frames, final[-1:])
                if number + 1 < len(chunks) and part.frames and state.checkpoint_due():
                    state.close_part(part, chunk[-1], blender.pending)
                    part = _Part(state.folder, segment, chunk[-1] + 1, blender.emitted)
    finally:
        part.discard()
    assert written == segment.frames, (written, segment.frames)
    state.complete(segment, blender.pending)
