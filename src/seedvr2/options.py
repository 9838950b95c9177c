"""Every user-facing option, defined once: name, type, default, range/choices, help.

The CLI flags, the ComfyUI node inputs and the workflow inputs are generated from or checked
against this table. ``resolve_options(**given)`` validates options and fills in defaults;
errors name the option and the fix, in the caller's own words (``text_embeddings=PATH`` in
Python, ``--text-embeddings PATH`` on the command line: :func:`option_ref`, and the
``seedvr2`` command runs inside :func:`spoken_as_cli`).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Optional

from .errors import SeedVR2Error

COLOR_CORRECTIONS = ("lab", "wavelet", "wavelet_adaptive", "hsv", "adain", "none")
DTYPE_NAMES = ("auto", "fp32", "fp16", "bf16")


class OptionError(SeedVR2Error, ValueError):
    """An option value that cannot be used; the message names the option and the fix."""


# "python" (keyword arguments, the default) or "cli" (flags); set by spoken_as_cli().
_CALLER = contextvars.ContextVar("seedvr2_caller", default="python")


@contextlib.contextmanager
def spoken_as_cli():
    """Within this block, :func:`option_ref` names options as command-line flags."""
    token = _CALLER.set("cli")
    try:
        yield
    finally:
        _CALLER.reset(token)


def option_ref(name: str, value=None, *, flag: Optional[str] = None) -> str:
    """How the caller writes option ``name`` (set to ``value`` when given): ``name`` /
    ``name=value`` in Python; ``--name`` / ``--name value`` on the command line, ``True`` as
    the bare flag and ``False`` as ``--no-name``. ``flag``: a command-line flag not spelled
    like the keyword (``quantize --type`` for ``target``)."""
    if _CALLER.get() == "python":
        return name if value is None else f"{name}={value}"
    flag = flag or "--" + name.replace("_", "-")
    if value is True:
        return flag
    if value is False:
        return "--no-" + flag[2:]
    return flag if value is None else f"{flag} {value}"


MAX_QUOTED = 80  # characters of a value an error message quotes


def option_value(name: str, value) -> str:
    """An option and its value as an error's subject: ``batch_size = 8`` in Python,
    ``--batch-size 8`` on the command line; a long value by its beginning and length."""
    shown = repr(value) if _CALLER.get() == "python" else str(value)
    if len(shown) > MAX_QUOTED:
        shown = f"{shown[:MAX_QUOTED - 20]}... ({len(shown)} characters)"
    if _CALLER.get() == "python":
        return f"{name} = {shown}"
    return option_ref(name, shown)


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    description: str  # other options written as {their_name}; read it through .help
    choices: Optional[tuple] = None
    min: Optional[float] = None
    max: Optional[float] = None
    check: Optional[Callable[[Any], Optional[str]]] = None  # returns an error text or None
    accepts_auto: bool = False  # the string "auto" is also a value (resolved at run time)
    parse: Optional[Callable[[Any], Any]] = None  # any spelling -> the value; ValueError: why not

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        """The description, naming other options as the caller writes them (see option_ref)."""
        return self.description.format_map({name: option_ref(name) for name in OPTIONS})


def _batch_size_problem(value: int) -> Optional[str]:
    if value % 4 == 1:
        return None
    lower = max(1, value - (value - 1) % 4)
    upper = lower + 4
    return f"must be 4n+1 (1, 5, 9, 13, 17, 21, ...); nearest valid values: {lower} or {upper}"


_PLAIN_INT = re.compile(r" *(-?[0-9]+) *")
_PLAIN_FLOAT = re.compile(r" *(-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?|-?inf|nan) *",
                          re.IGNORECASE)


def plain_number(kind: type, text: str):
    """``text`` as an int or float spelled in plain ASCII decimal (spaces around allowed;
    floats also ``1e-3``, ``inf``/``nan`` for the range checks to name); else OptionError.
    Python's int()/float() also read ``1_0``, ``+3``, other scripts' digits (``١``) and
    newlines: a value spelled so is more likely a mistake than meant."""
    match = (_PLAIN_INT if kind is int else _PLAIN_FLOAT).fullmatch(text)
    if match is None:
        raise OptionError(f"not a plain decimal {kind.__name__}: {text!r}")
    return kind(match.group(1))


def _is_device(value: str) -> bool:
    return value in ("cpu", "cuda", "mps") or re.fullmatch("cuda:[0-9]+", value) is not None


def _device_problem(value: str) -> Optional[str]:
    return None if value == "auto" or _is_device(value) else "expected auto, cpu, cuda, cuda:N or mps"


def _offload_problem(value: str) -> Optional[str]:
    return None if value == "none" or _is_device(value) else "expected none, cpu, cuda or cuda:N"


def _devices_problem(value: str) -> Optional[str]:
    if value == "auto":
        return None
    devices = [d.strip() for d in value.split(",")]
    if not all(_is_device(d) and d != "mps" for d in devices):
        return "expected auto or a comma-separated list such as cuda:0,cuda:1 or cpu,cpu"
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) > 1:
        return "mixes CPU and GPU devices; use only cuda devices or only cpu"
    return None


def _even_problem(value: int) -> Optional[str]:
    # Outputs have even sizes (4:2:0 video): an odd short edge could not be what was asked for.
    return None if value % 2 == 0 else \
        f"must be even (outputs have even sizes); nearest valid values: {value - 1} or {value + 1}"


def _multiple_of(n: int, unit: str, alternative: str = "") -> Callable[[int], Optional[str]]:
    return lambda value: None if value % n == 0 else \
        f"must be a multiple of {n} {unit} (e.g. {value - value % n or n}){alternative}"


_tile_problem = _multiple_of(8, "pixels")
_slice_problem = _multiple_of(4, "frames", ", or 0 for no slicing")


def parse_scene_cuts(value):
    """The scene_cuts option as ``"auto"`` or a sorted tuple of cut frames (``off``: ``()``),
    from ``auto``, ``off``, text such as ``120, 348`` or a list of frame numbers. Empty text
    is refused: it may be a variable never set, and ``off`` says what is meant."""
    import operator

    text = value.strip(" ").lower() if isinstance(value, str) else None
    if text in ("auto", "off"):
        return "auto" if text == "auto" else ()
    try:
        cuts = [plain_number(int, v) for v in text.split(",")] if text is not None else \
            [operator.index(v) for v in value]
    except (TypeError, ValueError):
        raise OptionError("expected auto, off, or frame numbers such as 120,348 (digits 0-9 "
                          "separated by commas)") from None
    if any(v < 1 for v in cuts):
        raise OptionError("a cut is the first frame of a new shot, so at least 1 (frame 0 "
                          "starts the video); remove it")
    cuts.sort()
    twice = next((a for a, b in zip(cuts, cuts[1:]) if a == b), None)  # linear once sorted
    if twice is not None:
        raise OptionError(f"frame {twice} is given twice; give each cut once")
    return tuple(cuts)


def parse_fps(value: str):
    """The fps option as an exact Fraction, or None for auto."""
    import math

    if value == "auto":
        return None
    text = value.strip()
    if "/" in text:
        rate = Fraction(*(plain_number(int, part) for part in text.split("/", 1)))
    else:
        number = plain_number(float, text)
        if not math.isfinite(number):  # inf, nan, and 1e400 (which float reads as inf)
            raise OptionError("must be a finite number")
        rate = Fraction(number).limit_denominator(1001)
    if rate <= 0:
        raise OptionError("must be positive")
    if not MIN_FPS <= rate <= MAX_FPS:
        raise FpsRangeError(f"must be between {MIN_FPS} and {MAX_FPS} frames a second (what "
                            f"video containers and players handle)")
    return rate


class FpsRangeError(OptionError):
    """A well-formed frame rate that no video can have."""


MIN_FPS, MAX_FPS = Fraction(1, 1000), 1000


def _fps_problem(value: str) -> Optional[str]:
    try:
        parse_fps(value)
    except FpsRangeError as e:
        return str(e)
    except (ValueError, ZeroDivisionError):
        return "expected auto, or a positive rate such as 24, 29.97 or 30000/1001"
    return None


OPTIONS: dict[str, Option] = {o.name: o for o in [
    Option("seed", int, 42, "random seed; each batch draws from (seed, its first frame), so "
           "results do not depend on chunking or on which process runs a batch", min=0,
           max=2 ** 63 - 1),
    Option("resolution", int, 1080, "target short edge of the output in pixels, even (outputs have "
           "even sizes; padded to a multiple of 16 internally and cropped back)", min=16,
           max=16384, check=_even_problem),
    Option("max_resolution", int, 0, "cap on the output's long edge (0 = none); a larger "
           "result is scaled down to fit", min=0, max=16384),
    Option("batch_size", int, 5, "frames per temporal batch, 4n+1 (1 for single images; larger = "
           "better temporal consistency, more memory), or auto: the largest 4n+1 (at least 5, at "
           "most the clip) whose memory estimate fits the GPU's free memory (on the CPU: the "
           "available RAM)", min=1, max=1001, check=_batch_size_problem, accepts_auto=True),
    Option("uniform_batch_size", bool, False, "pad the last batch to {batch_size} so every "
           "batch has the same shape (helps torch.compile)"),
    Option("temporal_overlap", int, 0, "frames shared by consecutive batches and cross-faded "
           "in the output (must be < {batch_size})", min=0, max=1000),
    Option("prepend_frames", int, 0, "reversed copies of the first frames prepended as "
           "temporal context and removed from the output", min=0, max=1000),
    Option("chunk_size", int, 0, "frames in flight: batches are encoded, upscaled and decoded "
           "phase by phase per chunk of about this many frames (0 = one batch per chunk)",
           min=0, max=1_000_000),
    Option("color_correction", str, "wavelet", "colour correction of the output against the "
           "resized input", choices=COLOR_CORRECTIONS),
    Option("input_noise_scale", float, 0.0, "noise blended into the input frames before encoding "
           "(0-1); can reduce artifacts on very clean or high-resolution inputs", min=0.0, max=1.0),
    Option("latent_noise_scale", float, 0.0, "noise augmentation of the low-resolution latent "
           "(0-1), with the official resolution-dependent timestep shift", min=0.0, max=1.0),
    Option("text_embeddings", str, "auto", "text embeddings: auto (those inside the DiT file, "
           "else a file in the model folder whose width matches the DiT, else the official ones "
           "that come with this package) or a path to .safetensors/.pt with 'pos'"),
    Option("device", str, "auto", "compute device: auto (cuda if available, else cpu), cpu, "
           "cuda, cuda:N", check=_device_problem),
    Option("dtype", str, "auto", "compute precision: auto (bf16 on GPUs with it: NVIDIA 8.0+, AMD "
           "MI100/RDNA3+; else fp16; fp32 on CPU), fp32, fp16, bf16", choices=DTYPE_NAMES),
    # How quantised weights multiply (paths, GPUs, bounds): seedvr2.loading.lowp, docs/memory.md.
    Option("compute_precision", str, "auto", "auto: int8/fp8/fp4 matmuls on GPUs with them "
           "(comfy-kitchen); weights: dequantise", choices=("auto", "weights")),
    Option("fps", str, "auto", "frame rate of a video written from images or an image "
           "sequence, which carry none: 24, 29.97 or 30000/1001 (auto: a video source keeps "
           "its own rate; images need this for a video output)", check=_fps_problem),
    # -- placement and memory (seedvr2.memory) --
    Option("dit_device", str, "auto", "device the DiT computes on: auto (the GPU if there is "
           "one, else cpu), cpu, cuda, cuda:N", check=_device_problem),
    Option("vae_device", str, "auto", "device the VAE computes on: auto (the GPU if there is "
           "one, else cpu), cpu, cuda, cuda:N", check=_device_problem),
    Option("dit_offload_device", str, "none", "where the DiT waits while the VAE runs (none = "
           "stays on its device; cpu frees VRAM between phases)", check=_offload_problem),
    Option("vae_offload_device", str, "none", "where the VAE waits while the DiT runs",
           check=_offload_problem),
    Option("tensor_offload_device", str, "cpu", "where latents and frames wait between phases",
           check=_offload_problem),
    Option("cache_dit", bool, False, "keep the loaded DiT for the next run (same settings)"),
    Option("cache_vae", bool, False, "keep the loaded VAE for the next run (same settings)"),
    Option("blocks_to_swap", int, 0, "DiT blocks kept on {dit_offload_device} and streamed to the "
           "GPU one ahead of use (BlockSwap); more = less VRAM", min=0, max=1000),
    Option("swap_io_components", bool, False, "also keep the DiT's input/output layers on the "
           "offload device (BlockSwap)"),
    Option("attention_backend", str, "auto", "attention kernel of the DiT: auto "
           "(FlashAttention-3 on Hopper GPUs, compute capability 9.x, when the flash_attn_3 "
           "package is installed; else PyTorch's SDPA), or one kernel", choices=(
        "auto", "sdpa", "flash_attn_2", "flash_attn_3", "sageattn_2")),
    Option("vae_cudnn_benchmark", bool, False, "while the VAE runs on a GPU, let cuDNN time its "
           "convolution algorithms for each new shape and keep the fastest (the first call of "
           "a shape is slower); off leaves PyTorch's setting as it is"),
    Option("vae_channels_last", bool, False, "run the VAE's 3-D convolutions on channels-last "
           "(NDHWC) tensors and weights, the layout GPU tensor cores read without a transpose"),
    Option("vae_fp16_accumulation", bool, False, "fp16 VAE on a GPU: convolutions through "
           "comfy-kitchen's fp16_conv3d, accumulating in fp16 (faster, less exact; "
           "docs/memory.md); else ignored with a warning"),
    Option("vae_int8_cache", str, "off", "VAE causal cache tails of 64 MiB or more kept in int8 "
           "(lossy: docs/memory.md): on = on the VAE's device, host = in pinned host memory",
           choices=("off", "on", "host")),
    Option("vae_encode_tiled", bool, False, "encode in spatial tiles (bounded VRAM at any size)"),
    Option("vae_encode_tile_size", int, 512, "encode tile size in pixels", min=64, max=16384,
           check=_tile_problem),
    Option("vae_encode_tile_overlap", int, 64, "encode tile overlap in pixels", min=0, max=8192,
           check=_tile_problem),
    Option("vae_decode_tiled", bool, False, "decode in spatial tiles (bounded VRAM at any size)"),
    Option("vae_decode_tile_size", int, 512, "decode tile size in pixels", min=64, max=16384,
           check=_tile_problem),
    Option("vae_decode_tile_overlap", int, 64, "decode tile overlap in pixels", min=0, max=8192,
           check=_tile_problem),
    Option("vae_tiling_exact", bool, False, "tiled VAE equal to untiled (within 1e-5): every "
           "layer runs over the whole frame tile by tile, keeping frame-wide activations in "
           "host RAM (tens of GB for long 1080p batches; slower). Off: independent tiles "
           "cross-faded over the overlap (fast, little memory, slightly different at seams)"),
    # -- several processes (seedvr2.distributed) --
    Option("devices", str, "auto", "devices to split the video's batches over: auto (every "
           "visible GPU, else one CPU process; a named device means one process there), or a "
           "list such as cuda:0,cuda:1 or cpu,cpu",
           check=_devices_problem),
    Option("dist_timeout", float, 60.0, "seconds a rank waits for another before the job "
           "stops with an error naming it", min=1.0, max=86400.0),
    Option("sequence_parallel", int, 1, "ranks that share each batch's DiT call (Ulysses "
           "sequence parallelism, for batches too big for one device); must divide the number "
           "of devices and the DiT's attention heads", min=1, max=1024),
    Option("resume", bool, True, "file jobs: keep finished output in closed segments next to the "
           "output (.NAME.seedvr2-resume/) so that running the same job again after a crash, kill "
           "or cancel continues from the last verified piece (segments, and parts closed about "
           "every minute of work); false (--no-resume) discards them and starts over"),
    Option("compile", bool, False, "torch.compile each DiT block and the VAE"),
    Option("compile_backend", str, "inductor", "torch.compile backend", choices=(
        "inductor", "cudagraphs", "eager", "aot_eager")),
    Option("compile_mode", str, "default", "torch.compile mode", choices=(
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")),
    Option("compile_fullgraph", bool, False, "torch.compile fullgraph (fail on graph breaks)"),
    Option("compile_dynamic", str, "auto", "torch.compile dynamic shapes: auto (after the first "
           "change), true, false", choices=("auto", "true", "false")),
    # -- VAE causal temporal slicing (seedvr2.memory.tiling; exact) --
    Option("vae_encode_temporal_slice", int, 4, "encode each batch in causal temporal slices of "
           "this many frames (a multiple of 4; the first slice has one more): same result, memory "
           "of one slice instead of the batch (4, the default, is the official pipeline's setting; "
           "0 = the whole batch at once)", min=0, max=1_000_000, check=_slice_problem),
    Option("vae_decode_temporal_slice", int, 4, "decode each batch in causal temporal slices of "
           "this many output frames (a multiple of 4 = that / 4 latent frames; the first slice "
           "has one more): same result, memory of one slice instead of the batch (4, the "
           "default, is the official pipeline's setting; 0 = the whole batch at once)",
           min=0, max=1_000_000, check=_slice_problem),
    # Added after the first release: last, so saved workflows' widget values keep their places.
    Option("scene_cuts", str, "auto", "scene cuts no batch spans: auto (detected), off, or "
           "the frames that begin new shots, e.g. 120,348", parse=parse_scene_cuts),
    Option("min_scene_length", int, 1, "shortest shot {scene_cuts} auto makes, in frames (1: every "
           "cut): a closer cut is not made. Frames that return to the shot before them within 6 "
           "frames (or this) are a flash, no cut", min=1, max=1_000_000),
    Option("fit", str, "auto", "a job that will not fit: auto applies the cheapest change "
           "that does and says so; strict stops, naming it", choices=("auto", "strict")),
    Option("max_vram", float, 0.0, "GiB a job may plan to use per compute device; 0 = all free",
           min=0.0, max=1_000_000.0),
]}


# Every option's area, in the order help lists them (the CLI's flag groups); each option is in
# exactly one (tests/test_cli_and_import.py checks).
AREAS: dict[str, tuple[str, ...]] = {
    "input and output": ("resolution", "max_resolution", "fps", "resume"),
    "models": ("text_embeddings", "dtype", "compute_precision"),
    "quality and colour": ("seed", "batch_size", "temporal_overlap", "prepend_frames",
                           "scene_cuts", "min_scene_length", "color_correction",
                           "input_noise_scale", "latent_noise_scale"),
    "memory and VRAM": ("fit", "max_vram", "chunk_size", "device", "dit_device", "vae_device",
                        "dit_offload_device", "vae_offload_device", "tensor_offload_device",
                        "cache_dit", "cache_vae", "blocks_to_swap", "swap_io_components",
                        "vae_encode_tiled", "vae_encode_tile_size", "vae_encode_tile_overlap",
                        "vae_decode_tiled", "vae_decode_tile_size", "vae_decode_tile_overlap",
                        "vae_tiling_exact", "vae_encode_temporal_slice",
                        "vae_decode_temporal_slice", "vae_int8_cache"),
    "speed and compile": ("attention_backend", "vae_cudnn_benchmark", "vae_channels_last",
                          "vae_fp16_accumulation", "uniform_batch_size", "compile",
                          "compile_backend", "compile_mode", "compile_fullgraph",
                          "compile_dynamic"),
    "several GPUs": ("devices", "sequence_parallel", "dist_timeout"),
}


# Options that choose where or how a job runs, never what it computes: ranks on different devices
# agree on a job, and a re-run resumes it, whatever these say; every other option is in the job's
# identity (``pipeline.identity.job_identity``). ``fit`` and ``max_vram`` act only through the
# settings a fit changes, which are in the identity as run (docs/memory.md).
NOT_SHAPING_OUTPUT = frozenset({"device", "dit_device", "vae_device", "devices", "dist_timeout",
                                "resume", "cache_dit", "cache_vae", "fit", "max_vram"})


@dataclass(frozen=True)
class Options:
    """A complete, validated option set (attribute per option)."""

    values: dict

    def __getattr__(self, name):
        if name == "values":  # not set yet (unpickling): no recursion through this method
            raise AttributeError(name)
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def replace(self, **changes) -> "Options":
        return resolve_options(**{**self.values, **changes})


def is_auto(opt: Option, value) -> bool:
    return opt.accepts_auto and isinstance(value, str) and value.strip().lower() == "auto"


def _coerce(opt: Option, value):
    if opt.parse is not None:
        try:
            return opt.parse(value)
        except ValueError as e:
            raise OptionError(f"{option_value(opt.name, value)}: {e}") from None
    if is_auto(opt, value):
        return "auto"
    if opt.type is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise OptionError(f"{option_value(opt.name, value)}: expected true or false")
    if opt.type is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if opt.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if opt.type in (int, float) and isinstance(value, str):
        try:
            value = plain_number(opt.type, value)
        except ValueError:
            raise OptionError(f"{option_value(opt.name, value)}: expected a number"
                              + (" or auto" if opt.accepts_auto else "")) from None
    if not isinstance(value, opt.type) or isinstance(value, bool) and opt.type is not bool:
        raise OptionError(f"{option_value(opt.name, value)}: expected {opt.type.__name__}")
    return value


def resolve_options(**given) -> Options:
    """Validate ``given`` against :data:`OPTIONS` and fill in defaults."""
    unknown = [k for k in given if k not in OPTIONS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, OPTIONS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known options: {', '.join(OPTIONS)}"
        raise OptionError(f"unknown option {name!r}{hint}")
    values = {}
    for name, opt in OPTIONS.items():
        value = _coerce(opt, given.get(name, opt.default))
        if value == "auto" and opt.accepts_auto:
            values[name] = value
            continue
        if opt.choices is not None and value not in opt.choices:
            raise OptionError(f"{option_value(name, value)}: expected one of {', '.join(map(str, opt.choices))}")
        if isinstance(value, float) and value != value:  # NaN passes every comparison
            raise OptionError(f"{option_value(name, value)}: expected a number")
        if opt.min is not None and value < opt.min:
            raise OptionError(f"{option_value(name, value)}: must be at least {opt.min}")
        if opt.max is not None and value > opt.max:
            raise OptionError(f"{option_value(name, value)}: must be at most {opt.max}")
        if opt.check is not None and (problem := opt.check(value)):
            raise OptionError(f"{option_value(name, value)}: {problem}")
        values[name] = value
    for stage in ("encode", "decode"):
        size, overlap = values[f"vae_{stage}_tile_size"], values[f"vae_{stage}_tile_overlap"]
        if overlap >= size:
            raise OptionError(f"{option_value(f'vae_{stage}_tile_overlap', overlap)}: must be smaller "
                              f"than {option_ref(f'vae_{stage}_tile_size')} ({size}); lower the "
                              f"overlap or raise the size")
    # With batch_size auto, the batch size chosen is always larger than temporal_overlap.
    if values["batch_size"] != "auto" and values["temporal_overlap"] >= values["batch_size"]:
        raise OptionError(f"{option_value('temporal_overlap', values['temporal_overlap'])}: must be "
                          f"smaller than {option_ref('batch_size')} ({values['batch_size']})")
    return Options(values)
