"""A job's memory decision, made before any model loads (from configs and the files' headers,
:meth:`Weights.from_file`, so a fitted job loads each model once): ``batch_size`` auto resolved, the
job fitted to the memory available (``fit`` auto: the cheapest change, said in one line),
``max_vram`` applied, the budget checked. docs/memory.md#the-memory-budget."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from ..options import Options, option_ref
from . import budget as mem
from .device_choice import resolve_device, resolve_dtype, resolve_offload
from .tiling import settings_from_options

log = logging.getLogger("seedvr2")

MEMORY_CHECK_ENV = "SEEDVR2_MEMORY_CHECK"  # "warn": a job over budget only logs a warning

# A host's request for free memory before the budget measures it: make_room(device, bytes).
MakeRoom = Callable[[str, int], None]


@dataclass(frozen=True)
class ModelDevices:
    """Where a job's models compute and wait between phases (None: stays), and their dtype."""

    dit: torch.device
    vae: torch.device
    dtype: torch.dtype
    dit_offload: Optional[torch.device] = None
    vae_offload: Optional[torch.device] = None

    @classmethod
    def of(cls, opts: Options) -> "ModelDevices":
        device = resolve_device(opts.device)
        dit = resolve_device(opts.dit_device) if opts.dit_device != "auto" else device
        vae = resolve_device(opts.vae_device) if opts.vae_device != "auto" else device
        return cls(dit, vae, resolve_dtype(opts.dtype, dit),
                   resolve_offload(opts.dit_offload_device),
                   resolve_offload(opts.vae_offload_device))

    def placement(self, opts: Options) -> mem.Placement:
        """The budget's placement; BlockSwap swaps on CUDA only (elsewhere it is inactive)."""
        swapping = self.dit.type == "cuda" and self.dit_offload is not None
        text = lambda device: None if device is None else str(device)  # noqa: E731
        return mem.Placement(str(self.dit), str(self.vae), text(self.dit_offload),
                             text(self.vae_offload), opts.blocks_to_swap if swapping else 0,
                             bool(swapping and opts.swap_io_components))

    @property
    def compute(self) -> set:
        return {str(self.dit), str(self.vae)}


@dataclass(frozen=True)
class JobMemory:
    """What the memory decision knows besides the options: the models (configs, weight sizes),
    their devices, the text rows, and our models' bytes on each device (count as available)."""

    budget: mem.Budget
    devices: ModelDevices
    text_tokens: int = mem.TEXT_TOKENS
    own: Mapping[str, int] = field(default_factory=dict)

    def shape(self, opts: Options, size: tuple[int, int], batch: int) -> mem.BatchShape:
        return batch_shape(opts, size, batch, self.devices.dtype, self.text_tokens,
                           self.devices.compute)


def batch_shape(opts: Options, size: tuple[int, int], batch: int, dtype: torch.dtype,
                text_tokens: int, compute_devices: set) -> mem.BatchShape:
    """The budget's view of one batch; chunk tensors count only when they wait on a compute
    device (tensor_offload_device none or equal to the DiT's / VAE's device)."""
    (encode, encode_slice), (decode, decode_slice) = (settings_from_options(opts, stage)
                                                      for stage in ("encode", "decode"))
    waits_on = None if opts.tensor_offload_device == "none" else \
        str(resolve_device(opts.tensor_offload_device))
    chunk = opts.chunk_size if waits_on is None or waits_on in compute_devices else None
    return mem.BatchShape(size[0], size[1], batch, dtype.itemsize, text_tokens, encode, decode,
                          chunk, encode_slice, decode_slice, opts.color_correction,
                          opts.vae_int8_cache)


def plan_frames_of(frame_count: int, opts: Options) -> int:
    """Frames of the batch plan: the clip plus the prepended context frames."""
    return frame_count + min(opts.prepend_frames, max(frame_count - 1, 0))


def capped(known: dict, devices: set, max_vram: float) -> dict:
    """The memory on each device, at most ``max_vram`` GiB (0: no cap) on each accelerator of
    ``devices`` (the CPU only when none computes), an unknown one planning within the cap."""
    if not max_vram:
        return known
    cap = int(max_vram * mem.GIB)
    accelerators = {d for d in devices if d != "cpu"} or devices
    return {**known, **{d: min(known.get(d, cap), cap) for d in accelerators}}


def measured(memory: JobMemory) -> dict:
    """Bytes available to the job on each device where known (our models' tensors count); the
    CPU's is the host's RAM (a job past it fails in the allocator, naming no setting)."""
    available = {d: mem.device_available(torch.device(d), memory.own.get(d, 0))
                 for d in sorted(memory.devices.compute)}
    return {d: a for d, a in available.items() if a is not None}


def decide(memory: JobMemory, opts: Options, frame_count: int, size: tuple[int, int],
           make_room: Optional[MakeRoom] = None,
           fixed_batch: bool = False) -> tuple[Options, mem.Estimate]:
    """The options the job runs with and their estimate: ``make_room`` (a host: ComfyUI) asked
    for the largest batch's needs, then the devices measured (:func:`fit_options`)."""
    if make_room is not None:
        auto = opts.batch_size == "auto"
        biggest = mem.batch_candidates(plan_frames_of(frame_count, opts),
                                       opts.temporal_overlap)[0] if auto else opts.batch_size
        est = mem.estimate(memory.budget, memory.shape(opts, size, biggest),
                           memory.devices.placement(opts))
        _ask_for_room(make_room, est, memory.own, auto)
    return fit_options(memory, opts, frame_count, size, measured(memory), fixed_batch)


def fit_options(memory: JobMemory, opts: Options, frame_count: int, size: tuple[int, int],
                known: dict, fixed_batch: bool = False) -> tuple[Options, mem.Estimate]:
    """Resolve ``batch_size="auto"``, fit the job to ``known`` (bytes per device, capped by
    ``max_vram``) and check the budget (:class:`~.budget.BudgetError`). ``fixed_batch``: the
    batch plan is made (every rank of a distributed job runs it): a fit keeps the batch size."""
    place = memory.devices.placement(opts)
    known = capped(known, memory.devices.compute, opts.max_vram)
    auto = opts.batch_size == "auto"
    if auto:
        opts = opts.replace(batch_size=_auto_batch(memory, opts, frame_count, size, known))
    batch = memory.shape(opts, size, opts.batch_size)
    exact = tuple(stage for stage, tiles in (("encode", batch.encode_tiles),
                                             ("decode", batch.decode_tiles))
                  if tiles.enabled and tiles.exact)
    if exact:
        mem.check_exact_tiling(memory.budget.vae, batch, mem.host_available(), exact)
    floor = min(mem.smallest_batch(opts.temporal_overlap), opts.batch_size)
    opts, batch, place = _fitted(memory.budget, batch, place, known, opts,
                                 opts.batch_size if fixed_batch else floor)
    said = f"{option_ref('batch_size', 'auto')} ({batch.batch_size} frames)" if auto else None
    return opts, _checked_estimate(memory.budget, batch, place, known, floor, said)


def _auto_batch(memory: JobMemory, opts: Options, frame_count: int, size: tuple[int, int],
                known: dict) -> int:
    """``batch_size="auto"`` as a number (:func:`~.budget.auto_batch_size` on the
    accelerators of ``known``, else every device; ``fit`` strict refuses), said in one line."""
    plan_frames = plan_frames_of(frame_count, opts)
    limits = {d: a for d, a in known.items() if d != "cpu"} or known
    batch = mem.auto_batch_size(memory.budget, memory.shape(opts, size, 5),
                                memory.devices.placement(opts), limits, plan_frames,
                                opts.temporal_overlap, strict=opts.fit != "auto")
    log.info("batch_size auto: %d frames per batch (largest 4n+1 that fits %s for %dx%d "
             "output, %d frames)", batch, ", ".join(
                 f"{mem.gib(v)} on {d}" for d, v in limits.items()) or "the default",
             size[1], size[0], plan_frames)
    return batch


def _fitted(budget: mem.Budget, batch: mem.BatchShape, place: mem.Placement, known: dict,
            opts: Options, lowest: int):
    """The options, batch shape and placement to run with: with ``fit`` auto, a job over budget
    gets the cheapest settings that fit (keeping :data:`~.budget.AUTO_MIN_BATCH` frames where
    anything fits so, never below ``lowest``); unchanged when it fits or nothing does."""
    short = mem.shortfalls(mem.estimate(budget, batch, place), known)
    if opts.fit != "auto" or not short:
        return opts, batch, place
    found = mem.fit_job(budget, batch, place, known,
                        max(lowest, min(mem.AUTO_MIN_BATCH, batch.batch_size)))
    if found is None and lowest < min(mem.AUTO_MIN_BATCH, batch.batch_size):
        found = mem.fit_job(budget, batch, place, known, lowest)  # fewer frames, not nothing
    if found is None:
        return opts, batch, place  # the check names what to do
    need, have = short[0]
    cap = f" ({option_ref('max_vram', opts.max_vram)})" if opts.max_vram else ""
    log.warning("%s: the %s phase needs about %s on %s but %s is available%s; running with "
                "%s (costs: %s). %s stops instead", option_ref("fit", "auto"), need.phase,
                mem.gib(need.total), need.device, mem.gib(have), cap, found.describe(),
                "; ".join(found.costs), option_ref("fit", "strict"))
    return opts.replace(**dict(found.changes)), found.shape, found.place


def _ask_for_room(make_room: MakeRoom, est: mem.Estimate, own: Mapping[str, int],
                  auto: bool) -> None:
    """Ask the host for what ``est`` needs on each device beyond our models' tensors there,
    before measuring (docs/comfyui.md); an automatic CUDA batch asks for the share it plans in."""
    for device in sorted(est.devices):
        need = est.peak(device)
        if auto and device.startswith("cuda"):
            need = math.ceil(need / mem.AUTO_CUDA_SHARE)
        if need > own.get(device, 0):
            make_room(device, need - own.get(device, 0))


def _checked_estimate(budget: mem.Budget, batch: mem.BatchShape, place: mem.Placement,
                      known: dict, lowest: int, batch_text: Optional[str]) -> mem.Estimate:
    """The estimate, checked against the memory available (``known``); the refusal suggests
    no batch below ``lowest`` and names the batch as the caller gave it (``batch_text``)."""
    try:
        est = mem.check(budget, batch, place, known, min_batch=lowest, batch_text=batch_text)
    except mem.BudgetError as e:
        if os.environ.get(MEMORY_CHECK_ENV, "").strip().lower() != "warn":
            raise mem.BudgetError(f"{e} (to try anyway, set {MEMORY_CHECK_ENV}=warn)") from None
        log.warning("%s; running anyway (%s=warn)", e, MEMORY_CHECK_ENV)
        est = mem.estimate(budget, batch, place)
    for d in sorted(est.devices):
        log.debug("memory budget on %s: needs about %s, %s available", d, mem.gib(est.peak(d)),
                  mem.gib(known[d]) if d in known else "unknown (not checked)")
    for need in est.phases:
        log.debug("memory budget, %s phase on %s: %s (%s)", need.phase, need.device,
                  mem.gib(need.total), need.describe())
    return est
