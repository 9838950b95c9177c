"""ComfyUI nodes: thin adapters over the ``seedvr2`` library in ``src/seedvr2``.

The nodes are defined once in ``seedvr2.workflow.nodes``; this module adapts them to ComfyUI:
the V3 schema (``comfy_entrypoint``) where ComfyUI has it, else the classic
``NODE_CLASS_MAPPINGS``; a :class:`ComfyHost` giving the nodes ComfyUI's folders, progress bar,
interrupt flag and memory (``seedvr2.workflow.comfy_memory``); and the hooks that rewrite numz's
workflows (``seedvr2.workflow.numz``) and log clashing packs. docs/comfyui.md says what users
see of each.

Importing this module does no work: the library's heavy parts load when a node runs.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from .src.seedvr2.workflow.nodes import (CONTROL_MODE_KEY, NodeDef, NodeResult, build_nodes,
                                          input_spec, object_info, widget_default)
from .src.seedvr2.workflow.errors import WorkflowError
from .src.seedvr2.workflow.numz import (NUMZ_NODES, has_numz_nodes, translate_prompt,
                                         translate_workflow)

log = logging.getLogger("seedvr2")
# seedvr2.loading.registry.COMFY_FOLDER, spelled out: importing the registry loads torch.
COMFY_FOLDER = "SEEDVR2"
# Where ComfyUI's native SeedVR2 support keeps the DiT and the VAE (registry: comfy_folder).
NATIVE_FOLDERS = ("diffusion_models", "vae")

try:  # inside ComfyUI only; registered so SEEDVR2 entries of extra_paths.yaml add to it
    import folder_paths

    folder_paths.add_model_folder_path(COMFY_FOLDER, os.path.join(folder_paths.models_dir,
                                                                  COMFY_FOLDER))
except ImportError:
    folder_paths = None


class ComfyHost:
    """What our nodes need, from ComfyUI."""

    def __init__(self, node_id: Optional[str] = None):
        self.node_id = node_id
        self._bar = None

    # -- folders ---------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        """models/SEEDVR2's files, then those of ComfyUI's own SeedVR2 folders (the loaders
        keep the SeedVR2 files of their kind, told by name or header)."""
        if folder_paths is None:
            return []
        names = list(folder_paths.get_filename_list(COMFY_FOLDER))
        for folder in NATIVE_FOLDERS:
            names += [n for n in folder_paths.get_filename_list(folder) if n not in names]
        return names

    def model_path(self, name: str) -> Optional[Path]:
        if folder_paths is None:
            return None
        for folder in (COMFY_FOLDER, *NATIVE_FOLDERS):
            path = folder_paths.get_full_path(folder, name)
            if path:
                return Path(path)
        return None

    def model_folder(self) -> Path:
        if folder_paths is None:
            from .src.seedvr2.loading.registry import default_model_dir

            return default_model_dir()
        # models/SEEDVR2, even when extra_model_paths.yaml registered other folders first.
        return Path(folder_paths.models_dir) / COMFY_FOLDER

    def input_names(self) -> list[str]:
        if folder_paths is None:
            return []
        folder = folder_paths.get_input_directory()
        return sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))

    def input_path(self, name: str) -> Path:
        from .src.seedvr2.workflow.host import confined_input_path

        return confined_input_path(name, {"input": folder_paths.get_input_directory(),
                                          "output": folder_paths.get_output_directory(),
                                          "temp": folder_paths.get_temp_directory()})

    def output_file(self, prefix: str, suffix: str, width: int, height: int) -> tuple[Path, dict]:
        output_dir = folder_paths.get_output_directory()
        folder, name, counter, subfolder, _ = folder_paths.get_save_image_path(
            prefix, output_dir, width, height)
        os.makedirs(folder, exist_ok=True)
        filename = f"{name}_{counter:05}_{suffix}"
        return Path(folder) / filename, {"filename": filename, "subfolder": subfolder,
                                         "type": "output"}

    # -- progress, interruption, memory ------------------------------------------------------

    def progress(self, value: int, total: int) -> None:
        self._progress_bar(total).update_absolute(value, total)

    def preview(self, thumbnail) -> None:
        """The running node shows ``thumbnail`` ((h, w, 3) uint8, the newest finished frame)
        as its progress bar's preview: ComfyUI's ``ProgressBar.update_absolute(value, total,
        preview)`` with the ``("JPEG", PIL image, max size)`` its latent previews send
        (latent_preview.LatentPreviewer), bounded by ``--preview-size``
        (``comfy.cli_args.args.preview_size``); its server encodes the JPEG for the editor."""
        from comfy.cli_args import args
        from PIL import Image

        bar = self._progress_bar(1)
        image = Image.fromarray(thumbnail.numpy(), "RGB")
        bar.update_absolute(bar.current, bar.total,
                            ("JPEG", image, getattr(args, "preview_size", None)))

    def _progress_bar(self, total: int):
        import comfy.utils

        if self._bar is None:
            self._bar = comfy.utils.ProgressBar(total, node_id=self.node_id)
        return self._bar

    def interrupted(self) -> bool:
        import comfy.model_management

        return comfy.model_management.processing_interrupted()

    def raise_interrupted(self) -> None:
        import comfy.model_management

        comfy.model_management.throw_exception_if_processing_interrupted()

    def before_load(self, model_files=(), device: str = "auto") -> None:
        """Give our models room on our device: ComfyUI unloads its models (never our cached
        ones) only until the model files we are about to load fit, not all of them. The
        job asks for its activations once it knows them (:meth:`make_room`)."""
        import comfy.model_management as mm

        from .src.seedvr2.memory.cache import MODEL_CACHE
        from .src.seedvr2.workflow.comfy_memory import room_needed

        target = mm.get_torch_device() if device in ("auto", None) else device
        self.make_room(target, room_needed(model_files, MODEL_CACHE, str(target)))

    def make_room(self, device, need: int) -> None:
        """``need`` bytes free on ``device`` before the job's memory budget measures it
        (models and activations): under dynamic VRAM ComfyUI's idle models stay resident
        until memory is demanded, and ``free_memory`` is how it is demanded."""
        import comfy.model_management as mm

        from .src.seedvr2.memory.cache import MODEL_CACHE
        from .src.seedvr2.workflow.comfy_memory import unload_comfy_models

        unload_comfy_models(mm, MODEL_CACHE, need, device)

    def after_run(self) -> None:
        """Show the models we keep (cache_model) to ComfyUI's memory management, so it can
        evict them ("Unload models", or another node needing the memory); free the rest."""
        import gc

        import comfy.model_management as mm

        from .src.seedvr2.memory.cache import MODEL_CACHE
        from .src.seedvr2.workflow.comfy_memory import sync

        sync(mm, MODEL_CACHE)
        gc.collect()
        mm.soft_empty_cache()

    def warn(self, message: str) -> None:
        log.warning(f"SeedVR2: {message}")

    # -- VIDEO values: comfy_api's InputImpl.VideoFromFile / VideoFromComponents / VideoFromList
    # (VideoInput.get_components, get_dimensions, get_frame_count; VideoFromFile.
    # get_stream_source: a path, or a BytesIO of the whole container; what current ComfyUI's
    # VIDEO can carry on top of its file: VideoInput.has_pending_frame_edits,
    # VideoFromFile.get_active_trim_window (as_trimmed), a crop (as_cropped: seen through
    # VideoFromFile.get_dimensions, the crop's size); VideoFromList.videos, its parts (each a
    # VideoFromFile: core saves other parts into a BytesIO), and .complete_audio, an AUDIO for
    # all of it or None).

    def video_file(self, video) -> Optional[Path]:
        """A file that plays ``video`` whole, for streaming: a VideoFromFile's own file, or
        one in ComfyUI's temp folder that its in-memory container (a BytesIO) is copied into,
        or that the parts of a concatenation (VideoFromList) are written into one after the
        other (seedvr2.io.joined). None for any other video (frames, or edits only frames can
        show): it is then read as the frames ComfyUI makes of it (get_components applies its
        trim and crop)."""
        InputImpl = _comfy_api("InputImpl").InputImpl
        sources = _whole_file_sources(video, InputImpl)
        if sources is None:
            return None
        on_disk = [isinstance(s, (str, os.PathLike)) for s in sources]
        files = [Path(s) if path else self._spooled(s) for s, path in zip(sources, on_disk)]
        if isinstance(video, InputImpl.VideoFromFile):
            return files[0]
        from .src.seedvr2.io.joined import join_videos

        try:
            return join_videos(files, self.temp_file("SeedVR2/joined", ".mp4"),
                               self._soundtrack(getattr(video, "complete_audio", None)))
        finally:
            for file, path in zip(files, on_disk):
                if not path:
                    file.unlink(missing_ok=True)  # the parts' copies: joined now

    def video_size(self, video) -> Optional[tuple]:
        """(frames, height, width, frames already in RAM) without decoding, or None."""
        InputImpl = _comfy_api("InputImpl").InputImpl
        try:
            width, height = video.get_dimensions()
            frames = video.get_frame_count()
        except (AttributeError, ValueError, RuntimeError, NotImplementedError):
            return None
        frames_in_ram = getattr(InputImpl, "VideoFromComponents", ())
        return int(frames), int(height), int(width), isinstance(video, frames_in_ram)

    def _spooled(self, stream) -> Path:
        """A VideoFromFile's in-memory container (its BytesIO, at its start) copied into
        ComfyUI's temp folder a chunk at a time: the upscaler streams the copy (PyAV reads it a
        frame at a time, as any file), never the frames in memory."""
        import shutil

        path = self.temp_file("SeedVR2/input", ".video")
        stream.seek(0)
        with open(path, "wb") as out:
            shutil.copyfileobj(stream, out, 1 << 20)
        stream.seek(0)
        return path

    def _soundtrack(self, audio) -> Optional[Path]:
        """A concatenation's own AUDIO (ComfyUI's {"waveform", "sample_rate"}) encoded for
        the joined file, or None."""
        if audio is None:
            return None
        from .src.seedvr2.io import encode_audio

        return encode_audio(audio["waveform"], audio["sample_rate"],
                            self.temp_file("SeedVR2/audio", ".m4a"), "the concatenation's audio")

    def video_frames(self, video) -> tuple:
        try:
            components = video.get_components()
        except NotImplementedError:  # VideoFromList in some 0.3x releases
            from .src.seedvr2.io import MediaError

            raise MediaError(f"this ComfyUI cannot give the frames of a {type(video).__name__} "
                             f"(its get_components is not implemented): save the video with "
                             f"Save Video and upscale that file") from None
        return components.images, components.audio, components.frame_rate

    def file_video(self, path: Path):
        return _comfy_api("InputImpl").InputImpl.VideoFromFile(str(path))

    def frames_video(self, images, audio, fps):
        from fractions import Fraction

        api = _comfy_api("InputImpl", "Types")
        return api.InputImpl.VideoFromComponents(api.Types.VideoComponents(
            images=images, audio=audio, frame_rate=Fraction(fps)))

    def temp_file(self, prefix: str, suffix: str) -> Path:
        """The next free name in ComfyUI's temp folder (emptied when ComfyUI starts)."""
        temp_dir = folder_paths.get_temp_directory()
        folder, name, counter, _, _ = folder_paths.get_save_image_path(prefix, temp_dir)
        os.makedirs(folder, exist_ok=True)
        return Path(folder) / f"{name}_{counter:05}_{suffix}"


def _whole_file_sources(video, InputImpl) -> Optional[list]:
    """The stream sources (paths or BytesIO) that play ``video`` whole, one after the other:
    a VideoFromFile's own, or each part's of a VideoFromList whose parts all are unedited
    VideoFromFiles; None when frames alone can show it."""
    VideoFromList = getattr(InputImpl, "VideoFromList", None)  # current releases
    parts = video.videos if VideoFromList is not None and isinstance(video, VideoFromList) \
        else [video]
    sources = []
    for part in parts:
        if not isinstance(part, InputImpl.VideoFromFile):
            return None
        source = part.get_stream_source()
        if _has_edits(part, source, InputImpl):
            return None
        sources.append(source)
    return sources


def _has_edits(video, source, InputImpl) -> bool:
    """Does this VideoFromFile show anything but its whole file: ComfyUI's own answer
    (has_pending_frame_edits, in releases that have it), a trim window, or a crop? A crop has
    no getter: the video's get_dimensions() (the crop's size) differs from the file's, as a
    crop smaller than the frame always does (a crop of the whole frame changes nothing)."""
    pending = getattr(video, "has_pending_frame_edits", None)
    if pending is not None and pending():
        return True
    trim = getattr(video, "get_active_trim_window", None)
    if trim is not None and tuple(trim()) != (0.0, 0.0):
        return True
    if not hasattr(video, "as_cropped"):  # a release without crops
        return False
    try:
        return tuple(video.get_dimensions()) != \
            tuple(InputImpl.VideoFromFile(source).get_dimensions())
    # No readable video in it (found by the hostile tests: PyAV's errors, ComfyUI's
    # ValueError, or an AttributeError from a damaged stream without a decoder): no crop to
    # see. The reader then refuses the file, naming it.
    except Exception:
        return False


# ComfyUI's V3 API, the pinned version first: ``comfy_api.latest`` is the one that changes.
# v0_0_2 (0.3.75 and current releases, beside v0_0_3) has all we use: io, ComfyExtension,
# InputImpl, Types. (Today every version re-exports latest's classes; the pinned name is the
# one later releases keep as it is.)
COMFY_API_VERSIONS = ("comfy_api.v0_0_2", "comfy_api.latest")


def _comfy_api(*needed: str):
    """The first of COMFY_API_VERSIONS the installed ComfyUI has with all of ``needed``."""
    for name in COMFY_API_VERSIONS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if all(hasattr(module, attribute) for attribute in needed):
            return module
    raise ImportError(f"ComfyUI's comfy_api has no version with {', '.join(needed)}")


def _uses_v3() -> bool:
    """ComfyUI with the V3 node schema? Outside ComfyUI: no, and nothing is imported to find
    out."""
    if importlib.util.find_spec("comfy_api") is None:
        return False
    try:
        _comfy_api("ComfyExtension", "io")
    except ImportError:
        return False
    return True


def _accept_unlisted(node: NodeDef):
    """A validation classmethod for the node's inputs whose dropdown is a convenience
    (``accepts_unlisted``), or None. ComfyUI leaves the "value not in list" check to a node's
    validation function for the inputs that function takes by name; ours accepts every value
    (the node checks the file when it runs)."""
    names = [i.name for i in node.inputs if i.accepts_unlisted]
    if not names:
        return None

    def validate(cls, **values):
        return True
    # ComfyUI reads the argument names; a function taking **kwargs would skip the checks of
    # every input, so the signature names exactly these inputs.
    validate.__signature__ = inspect.Signature(
        [inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    return classmethod(validate)


# ---------------------------------------------------------------------------------------------
# Classic API


def _classic_class(node: NodeDef) -> type:
    def INPUT_TYPES(cls):
        host = ComfyHost()
        types = {"required": {i.name: tuple(input_spec(i, host)) for i in node.inputs
                              if not i.optional},
                 "hidden": {"unique_id": "UNIQUE_ID"}}
        optional = {i.name: tuple(input_spec(i, host)) for i in node.inputs if i.optional}
        if optional:
            types["optional"] = optional
        return types

    def run(self, **kwargs):
        result: NodeResult = node.run(ComfyHost(kwargs.pop("unique_id", None)), **kwargs)
        if result.ui:
            return {"ui": result.ui, "result": tuple(result.outputs)}
        return tuple(result.outputs)

    validate = _accept_unlisted(node)
    return type(node.id, (), {
        **({"VALIDATE_INPUTS": validate} if validate else {}),
        "INPUT_TYPES": classmethod(INPUT_TYPES),
        "RETURN_TYPES": tuple(o.type for o in node.outputs),
        "RETURN_NAMES": tuple(o.name for o in node.outputs),
        "OUTPUT_TOOLTIPS": tuple(o.tooltip for o in node.outputs),
        "FUNCTION": "run", "CATEGORY": node.category, "DESCRIPTION": node.description,
        "OUTPUT_NODE": node.output_node, "run": run, "__doc__": node.description,
    })


# ---------------------------------------------------------------------------------------------
# V3 schema


def _v3_input(io, inp, host):
    common = dict(tooltip=inp.tooltip, optional=inp.optional)
    if inp.type == "INT":
        made = io.Int.Input(inp.name, default=inp.default, min=inp.min, max=inp.max, step=inp.step,
                            control_after_generate=_control_mode(io, inp.control_after_generate),
                            **common)
        if inp.control_after_generate:  # (0.3.75's io.Int.Input takes no extra_dict argument)
            made.extra_dict = {**made.extra_dict, CONTROL_MODE_KEY: inp.control_after_generate}
        return made
    if inp.type == "FLOAT":
        return io.Float.Input(inp.name, default=inp.default, min=inp.min, max=inp.max,
                              step=inp.step, **common)
    if inp.type == "BOOLEAN":
        return io.Boolean.Input(inp.name, default=inp.default, **common)
    if inp.type == "STRING":
        return io.String.Input(inp.name, default=inp.default, **common)
    if inp.type == "COMBO":
        options = inp.options(host)
        made = io.Combo.Input(inp.name, options=options, default=widget_default(inp, options),
                              upload=io.UploadType(inp.upload) if inp.upload else None, **common)
        if inp.extras is not None:
            made.extra_dict = {**made.extra_dict, **inp.extras(host)}
        return made
    if inp.type == "IMAGE":
        return io.Image.Input(inp.name, **common)
    if inp.type == "VIDEO":
        return io.Video.Input(inp.name, **common)
    return io.Custom(inp.type).Input(inp.name, **common)


def _control_mode(io, mode: Optional[str]):
    """The seed's starting "control after generate" mode as V3 declares it. ComfyUI with
    ``io.ControlAfterGenerate`` (a str enum for ``io.Int.Input(control_after_generate=)``) ships
    an editor that starts the control widget at that mode; older editors (0.3.75's frontend
    1.32) take a string there for the widget's name, so they get true, and the pack's editor
    extension sets the mode from CONTROL_MODE_KEY."""
    if mode is None:
        return None
    modes = getattr(io, "ControlAfterGenerate", None)
    return modes(mode) if modes is not None else True


def _v3_output(io, out):
    kinds = {"IMAGE": io.Image, "STRING": io.String, "VIDEO": io.Video}
    kind = kinds.get(out.type) or io.Custom(out.type)
    # No id: V3 wants output ids distinct from input ids (the upscaler takes and gives "image").
    return kind.Output(display_name=out.name, tooltip=out.tooltip)


def _v3_class(node: NodeDef, io) -> type:
    class Node(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            host = ComfyHost()
            return io.Schema(node_id=node.id, display_name=node.display_name,
                             category=node.category, description=node.description,
                             inputs=[_v3_input(io, i, host) for i in node.inputs],
                             outputs=[_v3_output(io, o) for o in node.outputs],
                             hidden=[io.Hidden.unique_id], is_output_node=node.output_node)

        @classmethod
        def execute(cls, **kwargs):
            result = node.run(ComfyHost(cls.hidden.unique_id), **kwargs)
            return io.NodeOutput(*result.outputs, ui=result.ui)

    validate = _accept_unlisted(node)
    if validate is not None:
        Node.validate_inputs = validate
    Node.__name__ = Node.__qualname__ = node.id
    return Node


# ---------------------------------------------------------------------------------------------
# numz's workflows, and the numz pack beside ours

# How ComfyUI names this pack's nodes' module (nodes.load_custom_node: RELATIVE_PYTHON_MODULE,
# "custom_nodes." + the folder's name as ComfyUI found it).
OUR_MODULE = f"custom_nodes.{Path(__file__).parent.name}"
NUMZ_WORKFLOW_ROUTE = "/seedvr2/numz_workflow"  # web/seedvr2.js posts loaded workflows here


def _comfy_nodes():
    """ComfyUI's ``nodes`` module, when running inside ComfyUI (never imported here)."""
    return sys.modules.get("nodes") if folder_paths is not None else None


def _registered_by(cls) -> Optional[str]:
    return getattr(cls, "RELATIVE_PYTHON_MODULE", None)


def _numz_object_info() -> dict:
    """/object_info of our nodes that have numz's IDs and are the ones ComfyUI runs."""
    comfy = _comfy_nodes()
    mappings = getattr(comfy, "NODE_CLASS_MAPPINGS", {})
    host = ComfyHost()
    return {node.id: object_info(node, host) for node in build_nodes()
            if node.id in NUMZ_NODES and _registered_by(mappings.get(node.id)) == OUR_MODULE}


def _log_clashes(loading: bool) -> None:
    comfy = _comfy_nodes()
    if comfy is None:
        return
    our_ids = [n.id for n in build_nodes()]
    mappings = comfy.NODE_CLASS_MAPPINGS
    core = {i: _registered_by(mappings[i]) or "nodes" for i in our_ids
            if i in mappings and _is_core(mappings[i])}
    if core:
        log.warning(f"SeedVR2: {_core_clash(core)}")
    others = {i: cls for i, cls in mappings.items() if i not in core}
    for line in clashing_packs(our_ids, others, getattr(comfy, "LOADED_MODULE_DIRS", {}),
                               OUR_MODULE, loading=loading):
        log.warning(f"SeedVR2: {line}")


def clashing_packs(our_ids, class_mappings: dict, module_dirs: dict, our_module: str, *,
                   loading: bool) -> list[str]:
    """Log lines for each other pack that registers one of ``our_ids`` in ComfyUI's
    ``NODE_CLASS_MAPPINGS`` (folders: ``module_dirs``, ComfyUI's ``LOADED_MODULE_DIRS``).
    ``loading``: asked while this pack registers its nodes (ours replace the other's), else
    after every pack loaded (the other replaced ours). Empty when no other pack has our IDs."""
    def folder(module: str) -> str:
        return module_dirs.get(module.rpartition(".")[2], module)

    others: dict[str, list[str]] = {}
    for node_id in our_ids:
        cls = class_mappings.get(node_id)
        module = _registered_by(cls) if cls is not None else None
        if module and module != our_module:
            others.setdefault(module, []).append(node_id)
    lines = []
    for module, ids in others.items():
        winner = f"this pack's replace {module}'s" if loading else \
            f"{module}'s replaced this pack's"
        lines.append(f"two packs register the node IDs {', '.join(ids)}: {folder(module)} "
                     f"registers {', '.join(ids)}; this pack, {folder(our_module)}, registers "
                     f"{', '.join(our_ids)}. ComfyUI keeps the pack loaded last: {winner}. "
                     f"Remove one of them (this pack also opens numz's workflows).")
    return lines


def _is_core(cls) -> bool:
    """A class ComfyUI's core registers: its nodes.py (no RELATIVE_PYTHON_MODULE), comfy_extras
    or comfy_api_nodes (nodes.load_custom_node's module_parent for them)."""
    module = _registered_by(cls)
    return module is None or module.split(".")[0] in ("comfy_extras", "comfy_api_nodes")


def _core_clash(core: dict) -> str:
    """Core loads custom nodes with ``ignore=base_node_names`` (nodes.init_external_custom_nodes
    -> load_custom_node: the IDs core registered first), so for these IDs core's node stays and
    this pack's is dropped, whichever loads when."""
    ids = ", ".join(core)
    modules = ", ".join(sorted(set(core.values())))
    return (f"ComfyUI's core registers the node IDs {ids} ({modules}): ComfyUI keeps its own "
            f"and does not load this pack's {ids}: workflows with these IDs run ComfyUI's "
            f"nodes. Use ComfyUI's nodes there, or a release of this pack with other IDs.")


def _numz_prompt(json_data: dict) -> dict:
    """An API prompt sent to /prompt with numz's input names takes ours. A prompt that cannot
    be rewritten goes on as it came, and ComfyUI's validation names what is wrong (ComfyUI only
    logs a handler's exception, as a traceback)."""
    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    if has_numz_nodes(prompt):  # (our own prompts skip listing the model folders)
        try:
            json_data["prompt"], notes = translate_prompt(prompt, _numz_object_info())
        except WorkflowError as e:
            notes = [f"numz-layout nodes left as they are: {e}"]
        for note in notes:
            log.warning(f"SeedVR2: {note}")
    return json_data


def numz_workflow_reply(body) -> tuple[dict, int]:
    """The editor's numz route (web/seedvr2.js): the workflow with numz-layout nodes rewritten
    and the notes, or status 400 and the reason (the editor then opens it as it is)."""
    try:
        workflow, notes = translate_workflow(body, _numz_object_info())
    except WorkflowError as e:
        log.warning(f"SeedVR2: a workflow opened in the editor was left as it is: {e}")
        return {"error": str(e)}, 400
    for note in notes:
        log.warning(f"SeedVR2: {note}")
    return {"workflow": workflow, "notes": notes}, 200


def _hook_into_server() -> None:
    server = sys.modules.get("server") if folder_paths is not None else None
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None:
        return
    from aiohttp import web

    instance.add_on_prompt_handler(_numz_prompt)

    @instance.routes.post(NUMZ_WORKFLOW_ROUTE)
    async def numz_workflow(request):
        try:
            body = await request.json()
        except ValueError as e:  # (aiohttp reads the body with json.loads)
            return web.json_response({"error": f"not JSON: {e}"}, status=400)
        except RecursionError:
            return web.json_response({"error": "JSON nested too deeply"}, status=400)
        reply, status = numz_workflow_reply(body)
        return web.json_response(reply, status=status)

    async def after_every_pack_loaded(app):
        _log_clashes(loading=False)  # a pack loaded after ours replaced our nodes
    instance.app.on_startup.append(after_every_pack_loaded)


_hook_into_server()

NODE_DISPLAY_NAME_MAPPINGS = {node.id: node.display_name for node in build_nodes()}

if _uses_v3():
    _v3 = _comfy_api("ComfyExtension", "io")
    _io = _v3.io

    class SeedVR2Extension(_v3.ComfyExtension):
        async def get_node_list(self):
            _log_clashes(loading=True)  # a pack loaded before ours: ours replace its nodes
            return [_v3_class(node, _io) for node in build_nodes()]

    async def comfy_entrypoint() -> SeedVR2Extension:
        return SeedVR2Extension()

    API = "v3"
    NODE_CLASS_MAPPINGS = None  # ComfyUI reads the classic mappings first; V3 is used instead
else:
    API = "classic"
    NODE_CLASS_MAPPINGS = {node.id: _classic_class(node) for node in build_nodes()}
    _log_clashes(loading=True)
