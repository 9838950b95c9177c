"""A job and its set-up, the one recipe of one process and of every rank: fit the options to
this device's memory from the weight files' headers (:mod:`seedvr2.memory.fit`), then load
each model once, placed as they say (:mod:`.model_loading`); a file job's output and plan."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from ..faults import NO_FAULTS, Faults
from ..io import open_media
from ..io.files import (VIDEO_SUFFIXES, FileOutput, frame_count, input_files,
                        refuse_input_as_output)
from ..loading import CheckpointError
from ..loading.registry import default_model_dir
from ..memory import budget as mem
from ..memory.fit import JobMemory, MakeRoom, ModelDevices, decide, fit_options
from ..memory.device_choice import resolve_device
from ..options import OptionError, Options
from .identity import ModelRef, model_refs
from .model_loading import load_models, resident_bytes
from .plan import make_plan
from .runner import JobStats, Models, Upscaler, output_size


@dataclass(frozen=True)
class Job:
    """What one job computes: validated options, both models (:class:`.identity.ModelRef`),
    the model folder and the tests' faults. Picklable: spawned ranks resolve its models
    themselves (:meth:`resolved`: a missing file is then the failing rank's error)."""

    opts: Options
    models: tuple[ModelRef, ModelRef]
    model_dir: Path
    faults: Faults = NO_FAULTS
    # The host's request for free memory (memory.fit.decide); one process only, never pickled.
    make_room: Optional[MakeRoom] = field(default=None, compare=False)
    # A ``preview.FramePreview`` where frames are blended: here, or the writer rank (relaying it).
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

    def memory(self, where: ModelDevices) -> JobMemory:
        """What the memory budget needs of this (resolved) job's models, none loaded: configs
        and weight sizes from the files' headers, and the bytes already held on each device."""
        sized = [(mem.Weights.of_module(ref.model), ref.model.config) if ref.loaded else
                 mem.Weights.from_file(ref.model, ref.kind, where.dtype) for ref in self.models]
        budget = mem.Budget(sized[0][1], sized[1][1], sized[0][0], sized[1][0])
        return JobMemory(budget, where, own=resident_bytes(self.models, self.opts, where))

    def prepare(self, frame_count: int, size: tuple[int, int],
                stats: Optional[JobStats] = None,
                fixed_batch: bool = False) -> tuple[Models, Options]:
        """This device checked against the memory budget before any model loads (``batch_size``
        auto resolved, ``fit`` applied, ``stats`` told), then each model loaded once as the
        resulting options say; returns the models and those options."""
        job = self.resolved()
        opts, est = decide(job.memory(ModelDevices.of(job.opts)), job.opts, frame_count, size,
                           job.make_room, fixed_batch)
        _record(stats, opts, job.opts.batch_size == "auto", est)
        models = load_models(*(ref.model for ref in job.models), opts=opts,
                             model_dir=job.model_dir)
        return models, opts

    def ready_upscaler(self, frame_count: int, size: tuple[int, int], build=Upscaler,
                       fixed_batch: bool = False, **upscaler_args) -> Upscaler:
        """:meth:`prepare`, then ``build(models, opts, **upscaler_args)``."""
        return build(*self.prepare(frame_count, size, upscaler_args.get("stats"), fixed_batch),
                     **upscaler_args)


def _record(stats: Optional[JobStats], opts: Options, auto: bool, est: mem.Estimate) -> None:
    if stats is not None:
        stats.batch_size, stats.batch_size_auto = opts.batch_size, auto
        stats.estimated_bytes = {d: est.peak(d) for d in est.devices}


def prepare_job(models: Models, opts: Options, frame_count: int, size: tuple[int, int],
                stats: Optional[JobStats] = None, make_room: Optional[MakeRoom] = None,
                fixed_batch: bool = False) -> Options:
    """The memory decision of :meth:`Job.prepare` for loaded models (custom pipelines): the options
    to run with, or ``BudgetError``; a fit that moves a model asks for it reloaded so."""
    where = ModelDevices(models.dit_device, models.vae_device, models.dtype, models.dit_offload,
                         models.vae_offload)
    memory = Job.build(opts, models.dit, models.vae).memory(where)
    ready, est = decide(replace(memory, text_tokens=models.text.shape[0]), opts, frame_count,
                        size, make_room, fixed_batch)
    _record(stats, ready, opts.batch_size == "auto", est)
    return ready


def fit_for_ranks(job: Job, devices: list[str], frame_count: int, size: tuple[int, int],
                  gather=None) -> Job:
    """The options of a job over several processes, which all run one batch plan: fitted once, as
    one process's, for the device with the least memory, from the weight files' headers; each rank
    then checks its own device keeping that batch. ``gather`` (torchrun: every rank calls this)
    turns this process's available bytes into every rank's; without it each device is measured from
    here, a CUDA one only for ``batch_size`` auto (measuring creates a CUDA context on it)."""
    opts = job.opts
    first = resolve_device(devices[0])
    measure = opts.batch_size == "auto" or first.type != "cuda"
    if gather is not None:
        values = gather(mem.device_available(first))
    else:
        values = [mem.device_available(resolve_device(d)) if measure else None for d in devices]
    ranks, values = len(values), [v for v in values if v is not None]
    if opts.batch_size != "auto" and not values and not opts.max_vram:
        return job  # nothing known here: each rank checks its own device
    if first.type != "cuda" and values:  # CPU ranks share the host's RAM
        values = [min(values) // ranks]
    try:
        job = job.resolved()
    except CheckpointError:
        if opts.batch_size == "auto":
            raise
        return job  # a file not found here: each rank reports it, as without a fit
    where = ModelDevices.of(opts.replace(device=str(first)))
    known = {str(first): min(values)} if values else {}
    fitted, _ = fit_options(job.memory(where), opts, frame_count, size, known)
    return job.with_options(fitted)


def file_output(reader, dst, opts: Options, codec: str = "h264",
                overwrite: bool = False) -> FileOutput:
    """A file job's output, from the input's header; one that would replace the input is refused."""
    refuse_input_as_output(input_files(reader), dst)
    info, video = reader.info, Path(str(dst)).suffix.lower() in VIDEO_SUFFIXES
    bit_depth = 16 if info.bit_depth == 16 or video and codec == "h265" else 8
    return FileOutput(dst, output_size(info.height, info.width, opts), bit_depth, codec,
                      overwrite, opts.fps)


def check_file_job(src, dst, opts: Options, codec: str, overwrite: bool,
                   other_inputs=()) -> None:
    """Raise what a file job would raise about its files, before any model loads (the output
    writer is opened under its temporary name and discarded). An output that is the input
    or one of ``other_inputs`` (a folder job's files still to be read) is refused."""
    with open_media(src) as reader:
        refuse_input_as_output([*input_files(reader), *other_inputs], dst)
        file_output(reader, dst, opts, codec, overwrite).open(reader.info).abort()


def plan_file(reader, opts: Options):
    """A file job's batch plan, the same in every process (``batch_size`` a number by now)."""
    if opts.batch_size == "auto":
        raise OptionError("batch_size = 'auto' must be resolved before the batch plan is made "
                          "(Job.prepare or fit_for_ranks)")
    return make_plan(frame_count(reader), opts)
