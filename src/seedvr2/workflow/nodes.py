"""Our ComfyUI nodes, defined once and independent of ComfyUI: each :class:`NodeDef` says what a
node takes (:class:`Input`), returns and does (``run(host, **inputs)``); the ComfyUI pack
(top-level ``nodes.py``) turns them into V3 or classic nodes with a ComfyUI :class:`Host`, the
headless runner gives them its own. Nodes stay thin: they parse inputs, call the facade
(:mod:`seedvr2.api`) and report progress. Option inputs come from the option table
(:mod:`seedvr2.options`); :data:`LOADER_SETTINGS` / :data:`UPSCALER_SETTINGS` rename some. What
users see: docs/comfyui.md. Imports only seedvr2.options; torch loads when a node runs."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Union

from ..errors import InputError
from ..faults import Faults
from ..options import OPTIONS, Option, OptionError, Options, resolve_options
from .shape import shown

log = logging.getLogger("seedvr2")

CATEGORY = "SeedVR2"
DIT_TYPE, VAE_TYPE, COMPILE_TYPE = "SEEDVR2_DIT", "SEEDVR2_VAE", "SEEDVR2_TORCH_COMPILE_ARGS"
WIDGET_TYPES = ("INT", "FLOAT", "BOOLEAN", "STRING", "COMBO")
MODEL_SUFFIXES = (".safetensors", ".gguf", ".pth", ".pt")
ATTENTION_BACKENDS = OPTIONS["attention_backend"].choices


Choices = Union[tuple, Callable[["Host"], list]]


@dataclass(frozen=True)
class Input:
    name: str
    type: str  # ComfyUI type: INT, FLOAT, BOOLEAN, STRING, COMBO, IMAGE, SEEDVR2_DIT, ...
    tooltip: str
    default: Any = None
    choices: Optional[Choices] = None  # COMBO options; a callable is asked each time
    min: Optional[float] = None
    max: Optional[float] = None
    step: Optional[float] = None
    optional: bool = False
    control_after_generate: Optional[str] = None  # the editor's control widget's first mode
    upload: Optional[str] = None  # "image_upload" / "video_upload": the editor adds an upload widget
    accepts_unlisted: bool = False  # choices are a convenience: others are checked when it runs
    # More keys of the input's spec (/object_info), read by the pack's editor extension.
    extras: Optional[Callable[["Host"], dict]] = None

    @property
    def is_widget(self) -> bool:
        return self.type in WIDGET_TYPES

    def options(self, host: "Host") -> list:
        choices = self.choices(host) if callable(self.choices) else self.choices
        return list(choices or ())


@dataclass(frozen=True)
class Output:
    name: str
    type: str
    tooltip: str


@dataclass
class NodeResult:
    outputs: tuple = ()
    ui: Optional[dict] = None  # what ComfyUI shows on the node (previews, saved files)


@dataclass(frozen=True)
class NodeDef:
    id: str
    display_name: str
    description: str
    inputs: tuple
    outputs: tuple
    run: Callable[..., NodeResult]  # run(host, **inputs)
    output_node: bool = False
    category: str = CATEGORY

    def input(self, name: str) -> Input:
        return next(i for i in self.inputs if i.name == name)


class Host(Protocol):
    """What a node needs from whoever runs it (ComfyUI, or the headless runner)."""

    def model_names(self) -> list[str]: ...  # files in the model folders, relative names
    def input_names(self) -> list[str]: ...  # files in the input folder
    def model_path(self, name: str) -> Optional[Path]: ...
    def model_folder(self) -> Path: ...  # where missing model files should go
    def input_path(self, name: str) -> Path: ...
    def output_file(self, prefix: str, suffix: str, width: int, height: int) -> tuple[Path, dict]: ...
    def progress(self, value: int, total: int) -> None: ...
    def preview(self, thumbnail) -> None: ...  # the newest finished frame, (h, w, 3) uint8
    def interrupted(self) -> bool: ...
    def raise_interrupted(self) -> None: ...  # raises the host's own interruption, if flagged
    def before_load(self, model_files=(), device: str = "auto") -> None: ...  # room for these files
    def make_room(self, device: str, need: int) -> None: ...  # room for the job's estimate
    def after_run(self) -> None: ...  # give memory back
    def warn(self, message: str) -> None: ...
    # VIDEO values, in the host's own form (ComfyUI's VideoInput; headless core_nodes.Video):
    def video_file(self, video) -> Optional[Path]: ...  # a file it plays whole, to stream
    def video_size(self, video) -> Optional[tuple]: ...  # (frames, H, W, frames in RAM already)
    def video_frames(self, video) -> tuple: ...  # (IMAGE frames, AUDIO or None, frame rate)
    def file_video(self, path: Path): ...  # a VIDEO playing this file
    def frames_video(self, images, audio, fps): ...  # a VIDEO of these frames, audio and rate
    def temp_file(self, prefix: str, suffix: str) -> Path: ...  # where an in-graph result goes


AUTO_INT = 0  # the INT widget value of options that also accept "auto" (batch_size)


def _from_widget(name: str, value):
    """A node input's value as the library option takes it (0 -> "auto" where accepted)."""
    opt = OPTIONS.get(name)
    return "auto" if opt is not None and opt.accepts_auto and value == AUTO_INT else value


def option_input(opt: Option, name: Optional[str] = None, optional: bool = False) -> Input:
    """A node input for a library option: same type, default, range, choices; help = tooltip."""
    kw = dict(name=name or opt.name, tooltip=opt.help, default=opt.default, optional=optional)
    if opt.choices is not None:
        return Input(type="COMBO", choices=tuple(opt.choices), **kw)
    if opt.type is bool:
        return Input(type="BOOLEAN", **kw)
    if opt.type is int:
        if opt.accepts_auto:  # an INT widget cannot hold "auto": 0 stands for it
            kw.update(tooltip=f"{kw['tooltip']} (0 = auto)",
                      default=AUTO_INT if opt.default == "auto" else opt.default)
            return Input(type="INT", min=AUTO_INT, max=opt.max, step=1, **kw)
        # A seed starts "fixed": "randomize", the editor's default, would change it after every
        # run, so ComfyUI could never reuse a finished upscale.
        return Input(type="INT", min=opt.min, max=opt.max, step=1,
                     control_after_generate="fixed" if opt.name == "seed" else None, **kw)
    if opt.type is float:
        return Input(type="FLOAT", min=opt.min, max=opt.max, step=0.01, **kw)
    return Input(type="STRING", **kw)


def _device_choices(host) -> list:
    """auto, cpu and the accelerators this machine has (asked when the node is listed)."""
    import torch

    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = ["mps"] if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() else []
    return ["auto", "cpu", *cuda, *mps]


def _offload_choices(host) -> list:
    return ["none"] + [d for d in _device_choices(host) if d not in ("auto", "mps")]


@dataclass(frozen=True)
class Setting:
    """A node input that is a library option under another name: all but how the editor shows it
    (``choices``: a device dropdown of this machine's; ``step``) comes from the option. An input
    that is not one option (``torch_compile_args``) gives ``input_def`` and ``to_options``."""

    input: str
    option: str
    choices: Optional[Callable[["Host"], list]] = None
    step: Optional[float] = None
    to_options: Optional[Callable[[Any], dict]] = None  # value -> {library option: value}
    input_def: Optional[Input] = None

    def node_input(self, optional: bool = False) -> Input:
        if self.input_def is not None:
            return replace(self.input_def, optional=optional or self.input_def.optional)
        made = option_input(OPTIONS[self.option], name=self.input, optional=optional)
        if self.choices is not None:
            made = replace(made, type="COMBO", choices=self.choices)
        if self.step is not None:
            made = replace(made, step=self.step)
        return made

    def library_options(self, value) -> dict:
        return self.to_options(value) if self.to_options else {self.option: value}


# torch_compile_args field -> library option; the compile settings node's cache limits have no
# library option yet and are passed on (or reported) only when changed from their defaults.
COMPILE_FIELDS = {field: f"compile_{field}" for field in (
    "backend", "mode", "fullgraph", "dynamic", "dynamo_cache_size_limit", "dynamo_recompile_limit")}
COMPILE_LIMIT_DEFAULTS = {"dynamo_cache_size_limit": 64, "dynamo_recompile_limit": 128}


def _compile_options(args) -> dict:
    if not args:
        return {}
    options = {"compile": True}
    for key, option in COMPILE_FIELDS.items():
        if key in args and args[key] != COMPILE_LIMIT_DEFAULTS.get(key, object()):
            options[option] = args[key]
    return options


def _model_input(kind: str) -> Input:
    return Input("model", "COMBO", f"the {kind.upper()} weights: a file found in models/SEEDVR2 "
                 f"(fp16, fp8, int8, GGUF or repackaged; listed first), or a released file marked "
                 f"'download' (fetched into models/SEEDVR2 when the node runs)",
                 choices=lambda host: model_choices(host, kind),
                 extras=lambda host: {DOWNLOADS_KEY: model_downloads(host, kind)})


def _input_videos(host: Host) -> list[str]:
    """The videos in the input folder (by extension), for Upscale Video File's list."""
    from ..io import VIDEO_EXTENSIONS

    return sorted(n for n in host.input_names() if Path(n).suffix.lower() in VIDEO_EXTENSIONS)


_COMPILE_SETTING = Setting(
    "torch_compile_args", "compile", to_options=_compile_options,
    input_def=Input("torch_compile_args", COMPILE_TYPE, "torch.compile settings from a SeedVR2 "
                    "Torch Compile Settings node (leave unconnected to run without compiling)",
                    optional=True))
_TILE_STEP = 8  # tile sizes and overlaps are multiples of 8 pixels

# The model-loader settings: node input -> library option (architecture table). The DiT and VAE
# loaders output a handle carrying these; the upscaler turns them into facade options.
LOADER_SETTINGS: dict[str, tuple] = {
    "dit": (
        Setting("device", "dit_device", choices=_device_choices),
        Setting("offload_device", "dit_offload_device", choices=_offload_choices),
        Setting("cache_model", "cache_dit"),
        Setting("blocks_to_swap", "blocks_to_swap"),
        Setting("swap_io_components", "swap_io_components"),
        Setting("attention_backend", "attention_backend"),
        Setting("dtype", "dtype"),
        Setting("text_embeddings", "text_embeddings"),
        Setting("compute_precision", "compute_precision"),
        _COMPILE_SETTING,
    ),
    "vae": (
        Setting("device", "vae_device", choices=_device_choices),
        Setting("offload_device", "vae_offload_device", choices=_offload_choices),
        Setting("cache_model", "cache_vae"),
        Setting("encode_tiled", "vae_encode_tiled"),
        Setting("encode_tile_size", "vae_encode_tile_size", step=_TILE_STEP),
        Setting("encode_tile_overlap", "vae_encode_tile_overlap", step=_TILE_STEP),
        Setting("decode_tiled", "vae_decode_tiled"),
        Setting("decode_tile_size", "vae_decode_tile_size", step=_TILE_STEP),
        Setting("decode_tile_overlap", "vae_decode_tile_overlap", step=_TILE_STEP),
        Setting("dtype", "dtype"),
        Setting("tiling_exact", "vae_tiling_exact"),
        Setting("encode_temporal_slice", "vae_encode_temporal_slice", step=4),
        Setting("decode_temporal_slice", "vae_decode_temporal_slice", step=4),
        Setting("cudnn_benchmark", "vae_cudnn_benchmark"),
        Setting("channels_last", "vae_channels_last"),
        Setting("fp16_accumulation", "vae_fp16_accumulation"),
        Setting("int8_cache", "vae_int8_cache"),
        _COMPILE_SETTING,
    ),
}

# Upscaler inputs that are not pipeline options.
UPSCALER_SETTINGS: tuple = (
    Setting("devices", "devices"),
    Setting("offload_device", "tensor_offload_device", choices=_offload_choices),
)

# The first release's settings (the first N per group) are required; later ones, appended (the
# editor saves widget values by position), are optional with their defaults: old workflows validate.
FIRST_RELEASE_SETTINGS = {"dit": 8, "vae": 10, "upscaler": 2}


def settings_inputs(group: str) -> tuple:
    """The node inputs of a settings group ("dit", "vae" or "upscaler")."""
    settings = UPSCALER_SETTINGS if group == "upscaler" else LOADER_SETTINGS[group]
    return tuple(s.node_input(optional=index >= FIRST_RELEASE_SETTINGS[group])
                 for index, s in enumerate(settings))


# Options set through the loaders or the upscaler's settings, not as pipeline inputs; and fps,
# for images written as video: the command line's only (nodes get frames or files with a rate).
_CLAIMED = ({s.option for group in LOADER_SETTINGS.values() for s in group}
            | {s.option for s in UPSCALER_SETTINGS}
            | {"device", "compile", "fps", *COMPILE_FIELDS.values()})


def pipeline_options() -> list[Option]:
    """The options the upscaler nodes take directly, in table order."""
    return [opt for name, opt in OPTIONS.items() if name not in _CLAIMED]


@dataclass(frozen=True)
class ModelHandle:
    """What a loader node outputs: which file, and the loader's settings (the upscaler loads)."""

    kind: str  # "dit" or "vae"
    name: str  # as chosen in the dropdown
    path: str  # the resolved file
    settings: tuple = ()  # ((input name, value), ...) in LOADER_SETTINGS order


def _file_kind(path: Path) -> Optional[str]:
    """'dit', 'vae', or None for a file that is neither (text embeddings, other weights)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return _kind_of_file(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _kind_of_file(path: str, size: int, mtime_ns: int) -> Optional[str]:
    from ..loading import CheckpointError, describe  # a header read once per size and time

    try:
        return describe(Path(path))["kind"]
    except (CheckpointError, OSError, ValueError):
        return None


def _local_models(host: Host, kind: str) -> list[str]:
    """The files of this kind in the model folders, sorted (released files known by name)."""
    from ..loading.registry import KNOWN_FILES

    found = []
    for name in host.model_names():
        if name in KNOWN_FILES:
            if KNOWN_FILES[name].kind == kind:
                found.append(name)
            continue
        if not name.lower().endswith(MODEL_SUFFIXES):
            continue
        path = host.model_path(name)
        if path is not None and _file_kind(path) == kind:
            found.append(name)
    return sorted(found)


def model_downloads(host: Host, kind: str) -> dict[str, Optional[int]]:
    """The released files of this kind not in the model folders: name -> approximate bytes
    (None: unknown), downloaded when the node runs. ComfyUI's native files are listed when
    present (in its own folders), never offered: our packaging offers the same models."""
    from ..loading.registry import COMFY_FOLDER, KNOWN_FILES, approximate_bytes

    local = set(host.model_names())
    return {name: approximate_bytes(name) for name, known in KNOWN_FILES.items()
            if known.kind == kind and known.comfy_folder == COMFY_FOLDER and name not in local}


def model_choices(host: Host, kind: str) -> list[str]:
    """The user's files first (a new node's default then needs no download), then downloads."""
    return _local_models(host, kind) + list(model_downloads(host, kind))


# The key of an INT input's spec giving the mode its "control after generate" widget starts at,
# for editors that know only true/false there (and start at "randomize"): web/seedvr2.js.
CONTROL_MODE_KEY = "seedvr2_control_mode"

# The key of a model input's spec that lists the choices still to download, with their sizes;
# the pack's editor extension (web/seedvr2.js) labels them in the dropdown.
DOWNLOADS_KEY = "seedvr2_downloads"


def _resolve_model(host: Host, kind: str, name: str) -> str:
    from ..loading.registry import resolve_model_file

    path = host.model_path(name)
    if path is not None and path.is_file():
        return str(path)
    # The registry's message: where to download it; names never reach outside the model folder.
    return str(resolve_model_file(name, host.model_folder(), kind, allow_paths=False,
                                  download_missing=True))


def _resolve_text_embeddings(host: Host, name) -> str:
    """``auto``, or a file in the model folder (model names' rules: no absolute path, ~ or ..)."""
    from ..loading import CheckpointError
    from ..loading.registry import model_path_in

    if not isinstance(name, str) or name.strip() == "auto":
        return name
    try:
        inside = model_path_in(host.model_folder(), name.strip())  # refuses names leading out
    except CheckpointError as e:
        raise CheckpointError(f"text_embeddings = {name!r}: {e}") from None
    path = host.model_path(name.strip()) or inside
    if not path.is_file():
        raise CheckpointError(f"text_embeddings {name!r}: no such file in the model folder "
                              f"{host.model_folder()} (use auto, or the name of a file there)")
    return str(path)


def _load_model_node(kind: str):
    def run(host: Host, model: str, **settings) -> NodeResult:
        path = _resolve_model(host, kind, model)
        if "text_embeddings" in settings:
            settings["text_embeddings"] = _resolve_text_embeddings(host,
                                                                   settings["text_embeddings"])
        _check_loader_settings(kind, settings)
        ordered = tuple((s.input, settings.get(s.input)) for s in LOADER_SETTINGS[kind])
        return NodeResult((ModelHandle(kind, model, path, ordered),))
    return run


def _check_loader_settings(kind: str, settings: dict) -> None:
    """Checked on the loader, in its input names (the upscaler would name the library's options)."""
    named = [s for s in LOADER_SETTINGS[kind] if s.to_options is None]
    given = {s.option: _from_widget(s.option, settings[s.input]) for s in named
             if settings.get(s.input) is not None and s.input != "text_embeddings"}
    try:
        resolve_options(**given)
    except OptionError as e:
        message = str(e)
        for s in sorted(named, key=lambda s: -len(s.option)):  # dit_offload_device first
            message = message.replace(s.option, s.input)
        raise OptionError(message) from None
    swapping = given.get("blocks_to_swap", 0) > 0 or given.get("swap_io_components") is True
    if kind == "dit" and swapping and given.get("dit_offload_device", "none") == "none":
        raise OptionError(f"blocks_to_swap = {given.get('blocks_to_swap', 0)}, swap_io_components "
                          f"= {given.get('swap_io_components', False)}: the swapped blocks need "
                          f"an offload device: set offload_device (cpu)")


def _torch_compile_settings(host: Host, **args) -> NodeResult:
    return NodeResult((dict(args),))


@dataclass
class FacadeRequest:
    """A node's facade options for one run, and what the library cannot honour yet."""

    options: dict = field(default_factory=dict)
    unsupported: list = field(default_factory=list)
    notes: list = field(default_factory=list)


def facade_request(dit: ModelHandle, vae: ModelHandle, upscaler: dict,
                   pipeline: dict) -> FacadeRequest:
    """Turn loader handles, upscaler settings and pipeline inputs into facade options."""
    request = FacadeRequest(options={name: _from_widget(name, v) for name, v in pipeline.items()})
    sources = [("SeedVR2 Load DiT Model", LOADER_SETTINGS["dit"], dict(dit.settings)),
               ("SeedVR2 Load VAE Model", LOADER_SETTINGS["vae"], dict(vae.settings)),
               ("upscaler", UPSCALER_SETTINGS, upscaler)]
    set_by: dict = {}
    for label, settings, values in sources:
        for setting in settings:
            value = values.get(setting.input)
            if value is None:  # an optional input left out: its option's default
                value = setting.node_input().default
            options = setting.library_options(value)
            for option, v in options.items():
                name = setting.input if len(options) == 1 else \
                    f"{setting.input}.{option.removeprefix('compile_')}"
                if option not in OPTIONS:  # a compile field the library has no option for
                    request.unsupported.append(f"{name} = {v!r} ({label}) is not supported yet; "
                                           f"ignored")
                elif option in request.options and request.options[option] != v:
                    request.notes.append(f"{name} = {v!r} ({label}) differs from "
                                     f"{request.options[option]!r} ({set_by.get(option, '')}): one "
                                     f"{option} for both models is supported; using "
                                     f"{request.options[option]!r}")
                else:
                    request.options[option] = v
                    set_by.setdefault(option, label)
    return request


def _progress_callback(host: Host) -> Callable[[str, int, int], None]:
    """One bar over encode + DiT + decode of every batch."""
    done: dict = {}

    def progress(phase: str, count: int, total: int):
        if phase == "frames":
            # Several devices report finished frames only; one process reports its phases.
            if not done:
                host.progress(count, total)
            return
        done[phase] = count
        host.progress(sum(done.values()), 3 * total)
    return progress


def _stop_check(host: Host) -> Callable[[], bool]:
    faults = Faults.from_environment()  # the tests' hold (seedvr2.faults); none in production
    checked = [False]

    def should_stop() -> bool:
        if faults.hold_until_interrupt and not checked[0]:
            checked[0] = True
            faults.hold_until_interrupted(host.interrupted)
        return host.interrupted()
    return should_stop


def _resolved(host: Host, dit: ModelHandle, vae: ModelHandle, inputs: dict) -> Options:
    """The node's options, resolved once, before anything loads; what cannot be honoured: warned."""
    upscaler = {s.input: inputs[s.input] for s in UPSCALER_SETTINGS if s.input in inputs}
    pipeline = {name: v for name, v in inputs.items() if name not in upscaler}
    request = facade_request(dit, vae, upscaler, pipeline)
    for message in request.unsupported + request.notes:
        host.warn(message)
    return resolve_options(**request.options)


def _run_facade(host: Host, dit: ModelHandle, vae: ModelHandle, opts: Options, call: Callable,
                live_preview: bool = True):
    """One facade ``call(dit path, vae path, model_dir=, progress=, should_stop=, opts=)``, which
    loads the models or takes them from the cache. ``live_preview`` (the newest finished frame) is
    off for a node showing its result: the editor (frontend 1.32 to 1.58, useNodeOutputStore's
    getNodeImageUrls) draws previews instead of outputs until the node reruns, hiding the video."""
    import torch

    from ..pipeline.runner import Interrupted

    model_dir = Path(dit.path).parent  # text embeddings "auto" look next to the DiT
    host.before_load((dit.path, vae.path), opts.dit_device)
    try:
        # ComfyUI runs nodes under torch.inference_mode(); models loaded there would hold
        # inference tensors, which the DiT's RoPE cache cannot key on (no version counter).
        # The pipeline enters inference mode itself.
        with torch.inference_mode(False):
            return call(dit.path, vae.path, model_dir=model_dir,
                        progress=_progress_callback(host), should_stop=_stop_check(host),
                        make_room=host.make_room,
                        preview=host.preview if live_preview else None, opts=opts)
    except Interrupted:
        host.raise_interrupted()
        raise
    finally:
        host.after_run()


def _as_comfy_image(frames):
    """ComfyUI IMAGEs are RGB or RGBA: gray results come back as three equal channels."""
    return frames.expand(-1, -1, -1, 3).contiguous() if frames.shape[-1] == 1 else frames


def _upscale_images(host: Host, image, dit: ModelHandle, vae: ModelHandle, **inputs) -> NodeResult:
    from ..api import upscale

    opts = _resolved(host, dit, vae, inputs)
    return NodeResult((_as_comfy_image(_run_facade(host, dit, vae, opts, partial(upscale, image))),))


PREVIEW_FRAMES = 4


def _preview(path: Path):
    """Up to PREVIEW_FRAMES frames spread over the output, as an IMAGE batch."""
    import torch

    from ..io import open_media
    from ..pipeline.runner import to_float_frame

    with open_media(path) as reader:
        count = reader.info.frame_count
        picks = sorted({round(i * (count - 1) / max(1, PREVIEW_FRAMES - 1))
                        for i in range(min(PREVIEW_FRAMES, count))})
        frames = []
        for index in picks:
            frame = next(iter(reader.frames(start=index, stop=index + 1)), None)
            if frame is not None:
                frames.append(to_float_frame(frame, index)[..., :3])
    return _as_comfy_image(torch.stack(frames))


MAX_NAME_BYTES = 200  # of a name in a filename_prefix: file systems hold 255, with the counter


def output_prefix(prefix: str, default: str) -> str:
    """The ``filename_prefix`` a node saves under: ``default`` (the node's) for one blank or naming
    no file (``"."``, ``"sub/.."``), where ComfyUI's numbering (``get_save_image_path``, and ours)
    would save a hidden ``._00001_`` file; a name no file system holds is refused at once."""
    normal = os.path.normpath(prefix.strip() or ".")
    if os.path.basename(normal) == ".":
        return default
    if any(len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
           for part in normal.split(os.sep)):
        raise InputError(f"filename_prefix = {shown(prefix)}: a file or folder name in it is "
                         f"longer than {MAX_NAME_BYTES} bytes")
    return prefix


VIDEO_FILE_PREFIX = "SeedVR2/video"  # Upscale Video File's default filename_prefix


def _upscale_video_file(host: Host, dit: ModelHandle, vae: ModelHandle, video_path: str,
                        filename_prefix: str, codec: str, **inputs) -> NodeResult:
    from ..api import upscale_file
    from ..io import IMAGE_EXTENSIONS, open_media
    from ..pipeline.runner import output_size

    if not video_path.strip():
        raise InputError("video_path is empty: give a video file in the input folder")
    try:  # a name outside the folders, or a missing or unreadable input: before any loading
        src = host.input_path(video_path.strip())
        with open_media(src) as reader:
            info = reader.info
    except (ValueError, OSError) as e:  # (MediaError included; OSError: a name too long)
        raise InputError(f"video_path = {shown(video_path)}: "
                         f"{e.strerror if isinstance(e, OSError) and e.strerror else e}") from None
    opts = _resolved(host, dit, vae, inputs)
    height, width = output_size(info.height, info.width, opts)
    suffix = ".png" if info.kind == "image" and Path(src).suffix.lower() in IMAGE_EXTENSIONS else ".mp4"
    dst, saved = host.output_file(output_prefix(filename_prefix, VIDEO_FILE_PREFIX), suffix,
                                  width, height)
    out = _run_facade(host, dit, vae, opts, partial(upscale_file, src, dst, codec=codec),
                      live_preview=False)  # the finished video plays on the node
    # The editor plays a node's "images" with "animated" set, as for ComfyUI's Save Video.
    ui = {"images": [saved]}
    if suffix == ".mp4":
        ui["animated"] = [True]
    return NodeResult((str(out), _preview(out)), ui=ui)


def _upscale_video(host: Host, video, dit: ModelHandle, vae: ModelHandle, codec: str,
                   **inputs) -> NodeResult:
    """A video file (or one the host streams into) is streamed, any length, to a temporary file,
    its audio and exact rate copied; a video of frames (Create Video, or edits only frames can
    show) is upscaled in memory, with its audio and rate, once it is known to fit."""
    from ..api import upscale, upscale_file

    opts = _resolved(host, dit, vae, inputs)
    source = host.video_file(video)
    if source is not None:
        dst = host.temp_file("SeedVR2/video", ".mp4")
        call_file = partial(upscale_file, source, dst, codec=codec)
        return NodeResult((host.file_video(_run_facade(host, dit, vae, opts, call_file)),))
    _check_frames_fit(host.video_size(video), opts)
    images, audio, fps = host.video_frames(video)
    if not 0 < float(fps) < float("inf"):  # (NaN fails too) a VIDEO no player or writer takes
        raise InputError(f"video: its frame rate is {fps} frames per second; give it a rate "
                         f"above 0 (Create Video's fps) and run again")
    frames = _as_comfy_image(_run_facade(host, dit, vae, opts, partial(upscale, images)))
    return NodeResult((host.frames_video(frames, audio, fps),))


FLOAT_BYTES = 4  # ComfyUI's IMAGE frames are float32


def _check_frames_fit(size: Optional[tuple], opts: Options) -> None:
    """Before a VIDEO's frames are taken into memory: log the RAM they and the upscaled frames
    will hold, and refuse (BudgetError, naming the way out) more than the host has available.
    ``size``: the host's ``video_size`` (None: not known without decoding, said in the log)."""
    from ..memory.budget import BudgetError, gib, host_available, known_size
    from ..pipeline.runner import output_size

    if size is None:
        log.info("the VIDEO is upscaled in memory; its size is not known before its frames are "
                 "taken")
        return
    frames, height, width, in_memory = size
    out_height, out_width = output_size(height, width, opts)
    taken = 0 if in_memory else frames * height * width * 3 * FLOAT_BYTES
    need = taken + frames * out_height * out_width * 3 * FLOAT_BYTES
    available = known_size(host_available(), "the host's RAM")
    log.info("the VIDEO is upscaled in memory: %d frames of %dx%d %s and %s upscaled to "
             "%dx%d: %s of RAM (%s available)", frames, width, height,
             "already in RAM" if in_memory else f"taken into RAM ({gib(taken)})",
             gib(need - taken), out_width, out_height, gib(need),
             gib(available) if available is not None else "unknown")
    if available is not None and need > available:
        raise BudgetError(
            f"the VIDEO ({frames} frames of {width}x{height}) is not a file that can be "
            f"streamed (frames, a trimmed or cropped video, or a concatenation of such), so it "
            f"would be upscaled in memory: {gib(need)} of RAM for its frames and the upscaled "
            f"ones at {out_width}x{out_height}, but {gib(available)} is available. Save it "
            f"with Save Video and upscale that file (Load Video, or SeedVR2 Upscale Video "
            f"File): a file is streamed, any length fits; or upscale fewer frames")


def _loader_inputs(kind: str) -> tuple:
    return (_model_input(kind), *settings_inputs(kind))


# The upscaler's options of the first release are required inputs; later ones optional (above).
FIRST_RELEASE_OPTIONS = frozenset((
    "seed", "resolution", "max_resolution", "batch_size", "uniform_batch_size",
    "temporal_overlap", "prepend_frames", "chunk_size", "color_correction", "input_noise_scale",
    "latent_noise_scale", "text_embeddings", "device", "dtype"))


# Options that mean something only when the node writes a file (resume): not on the others.
FILE_JOB_OPTIONS = frozenset(("resume",))


def _upscaler_inputs(*, writes_file: bool) -> tuple:
    return (*settings_inputs("upscaler"),
            *(option_input(opt, optional=opt.name not in FIRST_RELEASE_OPTIONS)
              for opt in pipeline_options()
              if writes_file or opt.name not in FILE_JOB_OPTIONS))


_DIT_IN = Input("dit", DIT_TYPE, "the DiT from a SeedVR2 Load DiT Model node")
_VAE_IN = Input("vae", VAE_TYPE, "the VAE from a SeedVR2 Load VAE Model node")


def _compile_settings_inputs() -> tuple:
    """The compile options (COMPILE_FIELDS), and the dynamo cache limits (no option yet)."""
    return (
        *(option_input(OPTIONS[COMPILE_FIELDS[field]], name=field)
          for field in ("backend", "mode", "fullgraph", "dynamic")),
        Input("dynamo_cache_size_limit", "INT", "compiled variants kept per function (raise it "
              "when many resolutions recompile)", COMPILE_LIMIT_DEFAULTS["dynamo_cache_size_limit"],
              min=1, max=1024, step=1),
        Input("dynamo_recompile_limit", "INT", "recompilations allowed per function before "
              "falling back to eager", COMPILE_LIMIT_DEFAULTS["dynamo_recompile_limit"], min=1,
              max=1024, step=1),
    )


def build_nodes() -> tuple:
    """The node definitions, built from the option table as it is now."""
    return (
        NodeDef("SeedVR2LoadDiTModel", "SeedVR2 Load DiT Model",
                "Choose the SeedVR2 DiT (3B or 7B; fp16, fp8, int8 or GGUF) and how it runs. The "
                "model loads when the upscaler runs.",
                _loader_inputs("dit"), (Output("dit", DIT_TYPE, "the DiT, for the upscaler"),),
                _load_model_node("dit")),
        NodeDef("SeedVR2LoadVAEModel", "SeedVR2 Load VAE Model",
                "Choose the SeedVR2 video VAE and how it runs (tiling bounds VRAM at high "
                "resolutions). The model loads when the upscaler runs.",
                _loader_inputs("vae"), (Output("vae", VAE_TYPE, "the VAE, for the upscaler"),),
                _load_model_node("vae")),
        NodeDef("SeedVR2TorchCompileSettings", "SeedVR2 Torch Compile Settings",
                "torch.compile settings for the DiT and VAE loaders (faster after the first run; "
                "needs a working compiler toolchain).",
                _compile_settings_inputs(),
                (Output("torch_compile_args", COMPILE_TYPE, "connect to a loader's "
                        "torch_compile_args"),), _torch_compile_settings),
        NodeDef("SeedVR2VideoUpscaler", "SeedVR2 Video Upscaler",
                "Upscale an image or a batch of video frames with SeedVR2 (one diffusion step). "
                "RGBA stays RGBA.",
                (Input("image", "IMAGE", "the frames to upscale (a batch is a video)"), _DIT_IN,
                 _VAE_IN, *_upscaler_inputs(writes_file=False)),
                (Output("image", "IMAGE", "the upscaled frames, same count and channels"),),
                _upscale_images),
        NodeDef("SeedVR2UpscaleVideoFile", "SeedVR2 Upscale Video File",
                "Upscale a video file to a new file in the output folder, streaming: frames are "
                "read, upscaled and written a batch at a time, so any length or resolution fits "
                "in memory. Audio is copied unchanged.",
                (_DIT_IN, _VAE_IN,
                 Input("video_path", "COMBO", "the video: one of the input folder's videos "
                       "(or upload one), or a name typed by hand inside the input folder (a "
                       "subfolder, an image or an image sequence pattern; 'name [output]' for "
                       "the output folder); other paths are refused",
                       choices=_input_videos, upload="video_upload", accepts_unlisted=True),
                 Input("filename_prefix", "STRING", "output name prefix in the output folder "
                       "(may contain subfolders)", VIDEO_FILE_PREFIX),
                 Input("codec", "COMBO", "h264 (8-bit) or h265 (10-bit)", "h264",
                       choices=("h264", "h265")),
                 *_upscaler_inputs(writes_file=True)),
                (Output("path", "STRING", "the written file"),
                 Output("preview", "IMAGE", f"up to {PREVIEW_FRAMES} frames of the result")),
                _upscale_video_file, output_node=True),
        NodeDef("SeedVR2UpscaleVideo", "SeedVR2 Upscale Video",
                "Upscale a VIDEO (from Load Video, Create Video, ...) to a VIDEO, for Save Video "
                "or other video nodes. A video file is streamed, a batch at a time, so any "
                "length fits in memory, and keeps its audio and exact frame rate.",
                (Input("video", "VIDEO", "the video to upscale"), _DIT_IN, _VAE_IN,
                 Input("codec", "COMBO", "the upscaled file's codec, for a video that is a "
                       "file: h264 (8-bit) or h265 (10-bit)", "h264", choices=("h264", "h265")),
                 *_upscaler_inputs(writes_file=False)),
                (Output("video", "VIDEO", "the upscaled video, with the input's audio and "
                        "frame rate"),),
                _upscale_video),
    )


def widget_default(inp: Input, options: list):
    """A new node's default; a dropdown without one: its first choice (for the search preview)."""
    if inp.default is None and inp.type == "COMBO" and options:
        return options[0]
    return inp.default


def input_spec(inp: Input, host: Host) -> list:
    """One input as the classic API (and /object_info) writes it: [type or options, {...}]."""
    extra = {"tooltip": inp.tooltip}
    options = inp.options(host) if inp.type == "COMBO" else []
    default = widget_default(inp, options)
    if default is not None:
        extra["default"] = default
    for key in ("min", "max", "step"):
        if getattr(inp, key) is not None:
            extra[key] = getattr(inp, key)
    if inp.control_after_generate:
        # Editors before ComfyUI's io.ControlAfterGenerate read a string here as the control
        # widget's name: true, and the mode under our key for the pack's editor extension.
        extra["control_after_generate"] = True
        extra[CONTROL_MODE_KEY] = inp.control_after_generate
    if inp.upload:
        extra[inp.upload] = True
    if inp.extras is not None:
        extra.update(inp.extras(host))
    if inp.type == "COMBO":
        return [options, extra]
    return [inp.type, extra]


def object_info(node: NodeDef, host: Host) -> dict:
    """``/object_info`` entry of a node: what the UI -> API conversion reads."""
    required = {i.name: input_spec(i, host) for i in node.inputs if not i.optional}
    optional = {i.name: input_spec(i, host) for i in node.inputs if i.optional}
    info = {"input": {"required": required}, "input_order": {"required": list(required)},
            "output": [o.type for o in node.outputs], "output_name": [o.name for o in node.outputs],
            "output_tooltips": [o.tooltip for o in node.outputs],
            "name": node.id, "display_name": node.display_name, "description": node.description,
            "category": node.category, "output_node": node.output_node}
    if optional:
        info["input"]["optional"] = optional
        info["input_order"]["optional"] = list(optional)
    return info
