"""A job's set-up, shared by one process and every rank of a distributed job: models loaded
and placed as the options say (through the model cache), the memory budget checked and
``batch_size="auto"`` resolved before any frame, and a file job's plan, output size and
writer. The facade (``seedvr2.api``) and ``seedvr2.distributed`` both call it.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import re
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from ..loading import load_dit, load_vae
from ..loading.quantized import set_compute_precision
from ..loading.registry import default_model_dir
from ..loading.text import load_text_embeddings
from ..memory import MODEL_CACHE, ModelKey, resolve_device, resolve_dtype, resolve_offload
from ..memory import budget as mem
from ..memory.blockswap import BlockSwap
from ..memory.compile import CompileSettings, apply_compile
from ..memory.placement import OffloadedModel, default_pin, host_copy_bytes
from ..memory.tiling import settings_from_options
from ..models.vae_paths import INT8_CACHE_BYTES, choose_paths
from ..options import OptionError, Options, option_ref
from ..faults import NO_FAULTS, Faults
from .identity import ModelRef, model_refs
from .plan import make_plan
from .runner import JobStats, Models, Upscaler, output_size

log = logging.getLogger("seedvr2")


def _settings_of(opts: Options, kind: str) -> tuple:
    """The options that shape a loaded model (its cache key besides file, dtype and device)."""
    compiled = CompileSettings.from_options(opts)
    if kind == "vae":
        return (compiled, opts.vae_offload_device)
    return (compiled, opts.blocks_to_swap, opts.swap_io_components, opts.dit_offload_device,
            opts.attention_backend)


def _check_host_copy(model, offload, setting: str):
    """The offloaded model's host copy must fit the host RAM (the model's own tensors already
    there are replaced by it, so they count as available)."""
    if offload is not None and offload.type == "cpu":
        available = mem.host_available()
        if available is not None:
            available += mem.bytes_on(model, offload)
        mem.check_host_copy(host_copy_bytes(model), available, setting)


def _placement(model, device, offload, setting: str):
    """An offloaded model waits in one persistent host copy (pinned on CUDA) between its
    phases; without an offload device it simply stays on its device."""
    if offload is None:
        return None
    _check_host_copy(model, offload, setting)
    return OffloadedModel(model, device, offload, default_pin(device, offload))


def _load_file(ref: ModelRef, opts: Options, dtype, device, offload):
    """A model file loaded, placed (a DiT with BlockSwap when asked) and compiled."""
    dit = ref.kind == "dit"
    swapping = dit and (opts.blocks_to_swap > 0 or opts.swap_io_components)
    if swapping and offload is None:
        raise OptionError(f"{option_ref('blocks_to_swap')}/{option_ref('swap_io_components')} need "
                          f"an offload device for the swapped weights: set "
                          f"{option_ref('dit_offload_device', 'cpu')} (or another device)")
    # An offloaded model loads on its offload device; only what runs reaches the GPU.
    model = (load_dit if dit else load_vae)(ref.model, dtype,
                                           offload if offload is not None else device)
    placement = None
    if dit:
        model.set_attention_backend(opts.attention_backend)
    if swapping:
        _check_host_copy(model, offload, "dit_offload_device")
        placement = BlockSwap(model, opts.blocks_to_swap, opts.swap_io_components, device, offload)
    if placement is None or not placement.active:  # no CUDA: plain offloading
        placement = _placement(model, device, offload, f"{ref.kind}_offload_device")
    apply_compile(*((model, None) if dit else (None, model)), CompileSettings.from_options(opts))
    return model, placement


def load_models(dit=None, vae=None, *, opts: Options, model_dir=None) -> Models:
    """DiT, VAE and text embedding placed and prepared as the options say (cached if asked)."""
    device = resolve_device(opts.device)
    dit_device = resolve_device(opts.dit_device) if opts.dit_device != "auto" else device
    vae_device = resolve_device(opts.vae_device) if opts.vae_device != "auto" else device
    dtype = resolve_dtype(opts.dtype, dit_device)
    dit_offload, vae_offload = (resolve_offload(opts.dit_offload_device),
                                resolve_offload(opts.vae_offload_device))
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    dit_ref, vae_ref = model_refs(dit, vae, model_dir)
    dit, dit_placement = _ready_model(dit_ref, opts, dtype, dit_device, dit_offload)
    vae, vae_placement = _ready_model(vae_ref, opts, dtype, vae_device, vae_offload)
    # Per run, not per load: they change how the VAE runs, not what it holds (a cached or
    # given VAE runs with this job's settings).
    vae.set_conv_settings(cudnn_benchmark=opts.vae_cudnn_benchmark, paths=choose_paths(
        vae_device, vae.dtype, channels_last=opts.vae_channels_last,
        fp16_accumulation=opts.vae_fp16_accumulation,
        int8_cache_bytes=None if opts.vae_int8_cache == "off" else INT8_CACHE_BYTES,
        cache_offload=opts.vae_int8_cache == "host"))
    for model in (dit, vae):
        set_compute_precision(model, opts.compute_precision)
    embedded = getattr(dit, "embedded_text_embeddings", None) or {}
    text = load_text_embeddings(opts.text_embeddings, dit.config.txt_in_dim, model_dir,
                                embedded=embedded.get("pos"))
    return Models(dit, vae, text, dit_device, vae_device, dtype, dit_offload, vae_offload,
                  dit_placement, vae_placement)


def _ready_model(ref: ModelRef, opts: Options, dtype, device, offload):
    """One model and its placement: a loaded module moved where the options say, a file
    loaded through the model cache."""
    setting = f"{ref.kind}_offload_device"
    if ref.loaded:
        model = ref.model.to(device=device if offload is None else offload, dtype=dtype)
        if ref.kind == "dit":
            model.set_attention_backend(opts.attention_backend)  # a loaded file's is set at load
        return model, _placement(model, device, offload, setting)
    key = ModelKey.for_file(ref.kind, ref.model, dtype, device, _settings_of(opts, ref.kind))
    return MODEL_CACHE.get_or_load(key, lambda: _load_file(ref, opts, dtype, device, offload),
                                   opts.cache_dit if ref.kind == "dit" else opts.cache_vae)


def _budget_job(opts: Options, size: tuple[int, int], batch: int, dtype: torch.dtype,
                text_tokens: int, compute_devices: set) -> mem.BatchShape:
    """The budget's view of one batch; chunk tensors count only when they wait on a compute
    device (tensor_offload_device none or equal to the DiT's / VAE's device)."""
    (encode, encode_slice), (decode, decode_slice) = (settings_from_options(opts, stage)
                                                      for stage in ("encode", "decode"))
    waits_on = None if opts.tensor_offload_device == "none" else \
        str(resolve_device(opts.tensor_offload_device))
    on_device = waits_on is None or waits_on in compute_devices
    chunk = opts.chunk_size if on_device else None
    return mem.BatchShape(size[0], size[1], batch, dtype.itemsize, text_tokens, encode, decode, chunk,
                          encode_slice, decode_slice, opts.color_correction, opts.vae_int8_cache)


MEMORY_CHECK_ENV = "SEEDVR2_MEMORY_CHECK"  # "warn": a job over budget only logs a warning


def plan_frames_of(frame_count: int, opts: Options) -> int:
    """Frames of the batch plan: the clip plus the prepended context frames."""
    return frame_count + min(opts.prepend_frames, max(frame_count - 1, 0))


# A host's request for free memory before the budget measures it: make_room(device, bytes).
MakeRoom = Callable[[str, int], None]


def prepare_job(models: Models, opts: Options, frame_count: int, size: tuple[int, int],
                stats: Optional[JobStats] = None, make_room: Optional[MakeRoom] = None,
                fixed_batch: bool = False) -> Options:
    """Resolve ``batch_size="auto"``, fit the job to the memory available (``fit`` auto: the
    cheapest change that fits, said in one line) and check the memory budget (raising
    :class:`~seedvr2.memory.budget.BudgetError`), before any work starts; returns the options
    the job runs with. ``make_room`` (a host such as ComfyUI) is first asked for what the
    job's largest batch needs; ``fixed_batch``: the batch plan is already made (every rank of
    a distributed job runs it), so a fit keeps the batch size. See
    docs/memory.md#the-memory-budget."""
    place = _placement_of(models, opts)
    budget = mem.Budget(models.dit.config, models.vae.config, mem.Weights.of_module(models.dit),
                        mem.Weights.of_module(models.vae))
    devices = {str(models.dit_device), str(models.vae_device)}
    job = lambda batch: _budget_job(opts, size, batch, models.dtype, models.text.shape[0], devices)  # noqa: E731
    auto = opts.batch_size == "auto"
    if make_room is not None:
        biggest = mem.batch_candidates(plan_frames_of(frame_count, opts),
                                       opts.temporal_overlap)[0] if auto else opts.batch_size
        _ask_for_room(make_room, mem.estimate(budget, job(biggest), place), models, auto)
    known = capped(_available_memory(models, devices), devices, opts.max_vram)
    if auto:
        opts = opts.replace(batch_size=_resolved_batch(budget, job(5), place, known,
                                                       plan_frames_of(frame_count, opts), opts,
                                                       size))
    batch = job(opts.batch_size)
    exact = tuple(stage for stage, tiles in (("encode", batch.encode_tiles),
                                             ("decode", batch.decode_tiles))
                  if tiles.enabled and tiles.exact)
    if exact:
        mem.check_exact_tiling(models.vae.config, opts.batch_size, size[0], size[1],
                               models.dtype.itemsize, batch.decode_slice, batch.encode_slice,
                               mem.host_available(), exact)
    opts, batch, place = _fitted(budget, batch, place, known, opts, fixed_batch)
    est = _checked_estimate(budget, batch, place, known)
    if stats is not None:
        stats.batch_size, stats.batch_size_auto = opts.batch_size, auto
        stats.estimated_bytes = {d: est.peak(d) for d in est.devices}
    return opts


def capped(known: dict, devices: set, max_vram: float) -> dict:
    """The memory available on each device, at most ``max_vram`` GiB on each compute device
    (0: no cap); a device whose memory is unknown plans within the cap."""
    if not max_vram:
        return known
    cap = int(max_vram * mem.GIB)
    return {**known, **{d: min(known.get(d, cap), cap) for d in devices}}


def _resolved_batch(budget, one_batch: mem.BatchShape, place, known: dict, plan_frames: int,
                    opts: Options, size: tuple[int, int]) -> int:
    """``batch_size="auto"`` as a number, said in one line; when not even the smallest batch
    fits, that one (``fit`` auto then changes other settings) or the error (``fit`` strict)."""
    cuda = {d: a for d, a in known.items() if d.startswith("cuda")}
    try:
        batch = _auto_batch(budget, one_batch, place, cuda or known, plan_frames, opts)
    except mem.BudgetError:
        if opts.fit != "auto":
            raise
        batch = mem.batch_candidates(plan_frames, opts.temporal_overlap)[-1]
    log.info("batch_size auto: %d frames per batch (largest 4n+1 that fits %s for %dx%d "
             "output, %d frames)", batch, ", ".join(
                 f"{mem.gib(v)} on {d}" for d, v in (cuda or known).items()) or "the default",
             size[1], size[0], plan_frames)
    return batch


def _fitted(budget, batch: mem.BatchShape, place, known: dict, opts: Options,
            fixed_batch: bool):
    """With ``fit`` auto, a job over budget gets the cheapest settings that fit (the batch
    size kept at least 5 frames where anything fits so, or as it is when ``fixed_batch``);
    returns the options, the
    budget's job and placement to run with (unchanged when it fits or nothing does)."""
    short = mem.shortfalls(mem.estimate(budget, batch, place), known)
    if opts.fit != "auto" or not short:
        return opts, batch, place
    lowest = batch.batch_size if fixed_batch else min(mem.AUTO_MIN_BATCH, batch.batch_size)
    found = mem.fit_job(budget, batch, place, known, lowest)
    if found is None and lowest > 1 and not fixed_batch:  # fewer frames rather than nothing
        found = mem.fit_job(budget, batch, place, known, 1)
    if found is None:
        return opts, batch, place  # the check names what to do
    need, have = short[0]
    cap = f" ({option_ref('max_vram', opts.max_vram)})" if opts.max_vram else ""
    log.warning("%s: the %s phase needs about %s on %s but %s is available%s; running with "
                "%s (costs: %s). %s stops instead", option_ref("fit", "auto"), need.phase,
                mem.gib(need.total), need.device, mem.gib(have), cap, found.describe(),
                "; ".join(found.costs), option_ref("fit", "strict"))
    return opts.replace(**dict(found.changes)), found.job, found.place


def _placement_of(models: Models, opts: Options) -> mem.Placement:
    return mem.Placement(
        str(models.dit_device), str(models.vae_device),
        str(models.dit_offload) if models.dit_offload is not None else None,
        str(models.vae_offload) if models.vae_offload is not None else None,
        models.blockswap.blocks_to_swap if models.blockswap is not None else 0,
        bool(opts.swap_io_components and models.blockswap is not None))


def _ask_for_room(make_room: MakeRoom, est: mem.Estimate, models: Models, auto: bool) -> None:
    """Ask the host for the bytes ``est`` needs on each device beyond our models' own tensors
    there, before memory is measured (why: docs/comfyui.md); an automatic batch on CUDA plans
    within :data:`~seedvr2.memory.budget.AUTO_CUDA_SHARE` of it, so asks for that much more."""
    for device in sorted(est.devices):
        need = est.peak(device)
        if auto and device.startswith("cuda"):
            need = math.ceil(need / mem.AUTO_CUDA_SHARE)
        own = _own_bytes(models, device)
        if need > own:
            make_room(device, need - own)


def _own_bytes(models: Models, device: str) -> int:
    """Bytes of our models' tensors on ``device``."""
    return (mem.bytes_on(models.dit, torch.device(device))
            + mem.bytes_on(models.vae, torch.device(device)))


def _available_memory(models: Models, devices: set) -> dict:
    """Bytes available to the job on each device where that is known (the models' own
    tensors there count as available). The CPU (and other devices) count the host's
    available RAM: a job past it fails in the allocator minutes into its work, naming no
    setting."""
    available = {d: mem.device_available(torch.device(d), _own_bytes(models, d))
                 for d in sorted(devices)}
    return {d: a for d, a in available.items() if a is not None}


def _auto_batch(budget, one_batch: mem.BatchShape, place, limits: dict, plan_frames: int,
                opts: Options) -> int:
    """The one ``batch_size="auto"`` decision: the largest batch whose estimate fits every
    device of ``limits`` (bytes available), else (nothing known) the smallest candidate."""
    if limits:
        return mem.auto_batch_size(budget, one_batch, place, limits, plan_frames,
                                   opts.temporal_overlap)
    return mem.batch_candidates(plan_frames, opts.temporal_overlap)[-1]


def _checked_estimate(budget, job: mem.BatchShape, place, known: dict):
    """The job's estimate, checked against the memory available (``known``)."""
    try:
        est = mem.check(budget, job, place, known)
    except mem.BudgetError as e:
        if os.environ.get(MEMORY_CHECK_ENV, "").strip().lower() != "warn":
            raise mem.BudgetError(f"{e} (to try anyway, set {MEMORY_CHECK_ENV}=warn)") from None
        log.warning("%s; running anyway (%s=warn)", e, MEMORY_CHECK_ENV)
        est = mem.estimate(budget, job, place)
    for d in sorted(est.devices):
        log.debug("memory budget on %s: needs about %s, %s available", d, mem.gib(est.peak(d)),
                  mem.gib(known[d]) if d in known else "unknown (not checked)")
    for need in est.phases:
        log.debug("memory budget, %s phase on %s: %s (%s)", need.phase, need.device,
                  mem.gib(need.total), need.describe())
    return est


def resolve_auto_batch_for_ranks(job: Job, devices: list[str], frame_count: int,
                                 size: tuple[int, int], gather=None) -> Job:
    """``batch_size="auto"`` for a job split over several processes, which must all use the
    same batch plan: resolved once, for the device with the least memory available, from
    the weight files' headers (no model is loaded). ``gather`` (torchrun: every rank calls
    this) turns this process's available bytes into every rank's list; without it (our
    launcher) the available memory of each listed device is asked from here, which creates
    a CUDA context on each of them in this process."""
    opts = job.opts
    if opts.batch_size != "auto":
        return job
    first = resolve_device(devices[0])
    dtype = resolve_dtype(opts.dtype, first)
    (dit_w, dit_cfg), (vae_w, vae_cfg) = (mem.Weights.from_file(ref.file, ref.kind, dtype)
                                          for ref in job.resolved().models)
    budget = mem.Budget(dit_cfg, vae_cfg, dit_w, vae_w)
    if gather is not None:
        values = gather(mem.device_available(first))
    else:
        values = [mem.device_available(resolve_device(d)) for d in devices]
    ranks = len(values)
    values = [v for v in values if v is not None]
    if first.type != "cuda" and values:  # CPU ranks share the host's RAM
        values = [min(values) // ranks]
    device = "cuda:0" if first.type == "cuda" else "cpu"
    place = mem.Placement(device, device)
    one_batch = _budget_job(opts, size, 5, dtype, mem.TEXT_TOKENS, {device})
    limits = capped({device: min(values)} if values else {}, {device}, opts.max_vram)
    batch = _auto_batch(budget, one_batch, place, limits, plan_frames_of(frame_count, opts), opts)
    log.info("batch_size auto: %d frames per batch on every rank", batch)
    return job.with_options(opts.replace(batch_size=batch))


@dataclass(frozen=True)
class Job:
    """What one job computes: validated options, both models
    (:class:`~seedvr2.pipeline.identity.ModelRef`), the model folder, and the tests' faults
    (none in production). Picklable: spawned ranks receive it as it is and resolve its models
    themselves (:meth:`resolved`: a missing file is then the failing rank's error)."""

    opts: Options
    models: tuple[ModelRef, ModelRef]
    model_dir: Path
    faults: Faults = NO_FAULTS
    # The host's request for free memory (:func:`prepare_job`); one process only, never
    # pickled to spawned ranks (the facade gives them none).
    make_room: Optional[MakeRoom] = field(default=None, compare=False)
    # Shows the host the newest finished frame (a ``preview.FramePreview``), where frames are
    # blended: this process, or the writer rank (spawned ranks get one that relays to the
    # launcher's; never pickled).
    preview: Optional[Callable] = field(default=None, compare=False)

    @classmethod
    def build(cls, opts: Options, dit=None, vae=None, model_dir=None,
              faults: Faults = NO_FAULTS, make_room: Optional[MakeRoom] = None,
              preview: Optional[Callable] = None) -> "Job":
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        return cls(opts, (ModelRef("dit", dit), ModelRef("vae", vae)), model_dir, faults,
                   make_room, preview)

    def resolved(self) -> "Job":
        """The job with its models resolved, once: files found or downloaded."""
        if all(ref.loaded or isinstance(ref.model, Path) for ref in self.models):
            return self
        return replace(self, models=model_refs(*(ref.model for ref in self.models),
                                               self.model_dir))

    def with_options(self, opts: Options) -> "Job":
        return replace(self, opts=opts)

    def prepare(self, frame_count: int, size: tuple[int, int],
                stats: Optional[JobStats] = None,
                fixed_batch: bool = False) -> tuple[Models, Options]:
        """The set-up of one process or one rank: the models loaded, then this device
        checked against the memory budget before any frame; returns them with the options
        this device runs (``batch_size`` auto resolved, ``fit`` applied; ``stats`` is told
        them and the estimate). A fit that moves a model (offload, BlockSwap) loads it again
        placed that way."""
        dit, vae = (ref.model for ref in self.models)
        models = load_models(dit, vae, opts=self.opts, model_dir=self.model_dir)
        opts = prepare_job(models, self.opts, frame_count, size, stats, self.make_room,
                           fixed_batch)
        if _placing(opts) == _placing(self.opts):
            return models, opts
        models = None  # the models placed the first way go before the second load
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        models = load_models(dit, vae, opts=opts, model_dir=self.model_dir)
        checked = prepare_job(models, opts.replace(fit="strict"), frame_count, size, stats,
                              self.make_room, fixed_batch)
        return models, checked.replace(fit=opts.fit)

    def ready_upscaler(self, frame_count: int, size: tuple[int, int], build=Upscaler,
                       fixed_batch: bool = False, **upscaler_args) -> Upscaler:
        """:meth:`prepare`, then ``build(models, opts, **upscaler_args)``."""
        return build(*self.prepare(frame_count, size, upscaler_args.get("stats"), fixed_batch),
                     **upscaler_args)


# The options that place the models: a fit changing one loads the models again.
_PLACING = ("dit_offload_device", "vae_offload_device", "blocks_to_swap", "swap_io_components")


def _placing(opts: Options) -> tuple:
    return tuple(opts.values[name] for name in _PLACING)


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
        """The writer of the output (:func:`open_output`)."""
        return open_output(info, self.dst, self.size, self.bit_depth, self.codec,
                           self.overwrite, self.fps)


def input_files(reader) -> list[Path]:
    """The files a file job reads: the video or image, or every file of an image sequence."""
    files = getattr(reader, "files", None)
    return [Path(f) for f in files] if files is not None else [Path(reader.info.path)]


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _numbered_names(out: Path, folder_output: bool) -> str:
    """A regular expression of the names beside ``out`` a writer may number (an image
    output's whatever its frame count, which a video's header may not tell exactly yet)."""
    from ..io._common import IMAGE_EXTENSIONS, PRINTF, printf_pattern

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
    from ..io import MediaError

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


def file_output(reader, dst, opts: Options, codec: str = "h264",
                overwrite: bool = False) -> FileOutput:
    """The output of a file job, from the input's header; first of all, an output that would
    replace the input is refused (:func:`refuse_input_as_output`)."""
    refuse_input_as_output(input_files(reader), dst)
    info, video = reader.info, Path(str(dst)).suffix.lower() in VIDEO_SUFFIXES
    bit_depth = 16 if info.bit_depth == 16 or video and codec == "h265" else 8
    return FileOutput(dst, output_size(info.height, info.width, opts), bit_depth, codec,
                      overwrite, opts.fps)


def frame_count(reader) -> int:
    info = reader.info
    return info.frame_count if info.frame_count_exact else reader.count_frames()


def check_file_job(src, dst, opts: Options, codec: str, overwrite: bool,
                   other_inputs=()) -> None:
    """Raise what a file job would raise about its files, before any model loads: the input
    is opened and the output writer is opened (under its temporary name) and discarded. An
    output that is the input, or one of ``other_inputs`` (the other files of a folder job,
    still to be read), is refused."""
    from ..io import open_media

    with open_media(src) as reader:
        refuse_input_as_output([*input_files(reader), *other_inputs], dst)
        file_output(reader, dst, opts, codec, overwrite).open(reader.info).abort()


def plan_file(reader, opts: Options):
    """Batch plan of a file job: the same in one process and on every rank of a distributed
    one. ``opts.batch_size`` must be a number by now (:func:`prepare_job`,
    :func:`resolve_auto_batch_for_ranks`)."""
    if opts.batch_size == "auto":
        raise OptionError("batch_size = 'auto' must be resolved before the batch plan is made "
                          "(prepare_job or resolve_auto_batch_for_ranks)")
    return make_plan(frame_count(reader), opts)


def open_output(info, dst, size: tuple[int, int], bit_depth: int, codec: str, overwrite: bool,
                fps: str = "auto"):
    """The writer for a file job's output: audio and subtitles copied from the source where
    the output holds them, a variable-rate source's frame times kept. ``fps`` (the option)
    gives images a rate; a video keeps its own."""
    import warnings

    from ..io import open_writer
    from ..options import option_value, parse_fps

    rate = parse_fps(fps)
    if rate is not None and info.fps is not None:
        warnings.warn(f"{option_value('fps', fps)} ignored: {info.path} is a video and keeps "
                      f"its own rate ({float(info.fps):.6g} fps), so its sound stays in sync",
                      stacklevel=2)
        rate = None
    return open_writer(dst, like=info, width=size[1], height=size[0], bit_depth=bit_depth,
                       codec=codec, fps=rate, audio_from=info, overwrite=overwrite)
