"""Workflows saved with the numz pack (ComfyUI-SeedVR2_VideoUpscaler), rewritten to our layout:
four of our node IDs are numz's own, with another input layout (:data:`NUMZ_NODES`); numz
v2.0-2.4's ``SeedVR2`` node becomes our loaders and upscaler (:data:`OLD_INPUTS`). Editor
workflows and API prompts, from ``/object_info`` entries (ours or a server's), with a note per
value that has no place here. How a layout is recognised, what users see: docs/comfyui.md
("Workflows from the numz pack")."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

from .errors import WorkflowError
from .execute import is_link
from .nodes import COMPILE_TYPE, CONTROL_MODE_KEY, WIDGET_TYPES
from .shape import LINK_FIELDS, check_editor_workflow, node_label, shown

CONTROL_VALUES = ("fixed", "increment", "decrement", "randomize")
NUMZ_COMPILE_TYPE = "TORCH_COMPILE_ARGS"  # numz's type for the compile settings link


@dataclass(frozen=True)
class NumzNode:
    """What numz v2.5.24's node of the same ID takes."""

    widgets: tuple  # its widget inputs in the order the editor saves them (required, optional)
    renamed: dict = field(default_factory=dict)  # numz input -> our input of the same meaning
    dropped: dict = field(default_factory=dict)  # numz-only input -> off value (no note)
    ours_only: tuple = ()  # ours since release 1, never numz's: a prompt with none is numz's


NUMZ_NODES = {
    "SeedVR2LoadDiTModel": NumzNode(
        ("model", "device", "blocks_to_swap", "swap_io_components", "offload_device",
         "cache_model", "attention_mode"),
        renamed={"attention_mode": "attention_backend"}, ours_only=("dtype", "text_embeddings")),
    "SeedVR2LoadVAEModel": NumzNode(
        ("model", "device", "encode_tiled", "encode_tile_size", "encode_tile_overlap",
         "decode_tiled", "decode_tile_size", "decode_tile_overlap", "tile_debug",
         "offload_device", "cache_model"),
        dropped={"tile_debug": "false"}, ours_only=("dtype",)),
    "SeedVR2TorchCompileSettings": NumzNode(
        ("backend", "mode", "fullgraph", "dynamic", "dynamo_cache_size_limit",
         "dynamo_recompile_limit")),
    "SeedVR2VideoUpscaler": NumzNode(
        ("seed", "resolution", "max_resolution", "batch_size", "uniform_batch_size",
         "color_correction", "temporal_overlap", "prepend_frames", "input_noise_scale",
         "latent_noise_scale", "offload_device", "enable_debug"),
        # new_resolution: numz's name for resolution in its late October 2025 commits
        renamed={"new_resolution": "resolution"}, dropped={"enable_debug": False},
        ours_only=("devices",)),
}


@dataclass(frozen=True)
class _Widget:
    name: str
    kind: str  # INT, FLOAT, BOOLEAN, STRING, COMBO
    extra: dict
    choices: Optional[list] = None

    @property
    def control(self) -> bool:  # the editor adds a "control after generate" value after it
        return bool(self.extra.get("control_after_generate")) or \
            self.kind == "INT" and self.name in ("seed", "noise_seed")

    @property
    def default(self):
        if "default" in self.extra:
            return self.extra["default"]
        return self.choices[0] if self.choices else None


def _inputs(info: dict) -> list[tuple[str, list]]:
    """(name, spec) of every input, in the editor's order (required, then optional)."""
    inputs = info.get("input", {})
    order = info.get("input_order") or {k: list(v) for k, v in inputs.items()}
    found = []
    for section in ("required", "optional"):
        specs = inputs.get(section) or {}
        found += [(name, specs[name]) for name in order.get(section, list(specs)) if name in specs]
    return found


def widget_inputs(info: dict) -> list[_Widget]:
    """A node's widget inputs, in the editor's order."""
    found = []
    for name, spec in _inputs(info):
        if not spec:
            continue
        kind, extra = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
        choices = kind if isinstance(kind, list) else None
        kind = "COMBO" if choices is not None else kind
        if kind in WIDGET_TYPES and not extra.get("forceInput"):
            found.append(_Widget(name, kind, extra, choices))
    return found


def is_ours(node_type: str, info: Optional[dict]) -> bool:
    """Is this /object_info entry our node (and not numz's, on a server that has numz)?"""
    table = NUMZ_NODES.get(node_type)
    if table is None or info is None:
        return False
    names = {name for name, _ in _inputs(info)}
    if any(name in names for name in (*table.renamed, *table.dropped)):
        return False
    wanted = {table.renamed.get(n, n) for n in table.widgets if n not in table.dropped}
    return wanted <= names and set(table.ours_only) <= names


# Choices that depend on the machine (files, devices): a value missing there is the user's to fix,
# and validation names it; other choices are fixed lists, and a numz value not in one is noted.
_MACHINE_CHOICES = ("model", "device", "offload_device")


def _fits(value, kind: str) -> bool:
    if kind == "BOOLEAN":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "INT":
        return isinstance(value, int) or isinstance(value, float) and value.is_integer()
    if kind == "FLOAT":
        return isinstance(value, (int, float))
    if kind == "STRING":
        return isinstance(value, str)
    return isinstance(value, (str, int, float))  # COMBO


def read_widget_values(values: list, names: list, controls: set) -> tuple[list, dict, int]:
    """Saved widget values walked in ``names`` order while they last: the (name, value) pairs, the
    "control after generate" values saved after each name in ``controls``, how many were read."""
    pairs, control, i = [], {}, 0
    for name in names:
        if i >= len(values):
            break
        pairs.append((name, values[i]))
        i += 1
        if name in controls and i < len(values) and values[i] in CONTROL_VALUES:
            control[name] = values[i]
            i += 1
    return pairs, control, i


def _read(values: list, names: list, controls: set) -> Optional[tuple[dict, dict]]:
    """(values by name, control values); None when the count does not match."""
    pairs, control, used = read_widget_values(values, names, controls)
    return (dict(pairs), control) if len(pairs) == len(names) and used == len(values) else None


def _our_layout(values: list, widgets: list[_Widget]) -> bool:
    """Values saved by our node: each fits its widget, in our order (older workflows: fewer)."""
    pairs, _, used = read_widget_values(values, [w.name for w in widgets],
                                        {w.name for w in widgets if w.control})
    return used == len(values) and all(_fits(v, w.kind) for w, (_, v) in zip(widgets, pairs))


def _to_ours(node_label: str, table: NumzNode, named: dict, widgets: dict[str, _Widget],
             notes: list) -> dict:
    """numz input names and values -> ours; what has no place here is noted and left out."""
    ours = {}
    for name, value in named.items():
        _check_widget_value(node_label, name, value)
        target = table.renamed.get(name, name)
        widget = widgets.get(target)
        if name in table.dropped and value == table.dropped[name]:
            continue
        if name in table.dropped or widget is None:  # (an input of another numz release too)
            notes.append(f"{node_label}: numz's {name} = {shown(value)} has no equivalent in "
                         f"this pack; dropped")
            continue
        if widget.choices is not None and isinstance(value, bool):
            # numz's switch for a setting that is a choice here (compile "dynamic")
            value = str(value).lower()
        if widget.choices is not None and value not in widget.choices \
                and widget.name not in _MACHINE_CHOICES:
            notes.append(f"{node_label}: numz's {name} = {shown(value)} is not available in "
                         f"this pack (choices: {', '.join(map(str, widget.choices))}); using "
                         f"{widget.default!r}")
            continue
        if _out_of_range(value, widget):
            notes.append(f"{node_label}: numz's {name} = {shown(value)} is outside this pack's "
                         f"range ({widget.extra.get('min')} to {widget.extra.get('max')}); using "
                         f"{widget.default!r}")
            continue
        ours[target] = value
    return ours


def _check_widget_value(node_label: str, name: str, value) -> None:
    """A list or an object is no widget value numz's node could have saved: refused, named."""
    if isinstance(value, (list, dict)):
        kind = "a list" if isinstance(value, list) else "an object"
        raise WorkflowError(f"{node_label}: numz's {name} = {shown(value)}: a widget value is "
                            f"a number, a text or a switch, not {kind}")


def _as_numz_ran(kind: str, label: str, ours: dict, widgets: dict[str, _Widget],
                 notes: list, numz_names: Optional[dict] = None) -> dict:
    """``ours`` with what numz's node did by itself, where ours refuses the values, made explicit
    (noted in numz's input names: ``numz_names``, ours -> numz's): its upscaler ran a
    temporal_overlap not smaller than batch_size as none (generation_phases: "temporal_overlap >=
    batch_size, resetting to 0"); its VAE tiling clamped a tile overlap to one latent pixel (8
    pixels) less than the tile (attn_video_vae's tiled_encode and tiled_decode)."""
    def value(name):
        return ours.get(name, widgets[name].default) if name in widgets else None

    def note(text):
        if text not in notes:  # (numz's one tile setting is both of ours)
            notes.append(text)

    def numz(name):
        return (numz_names or {}).get(name, name)

    ours = dict(ours)
    if kind == "SeedVR2VideoUpscaler":
        overlap, batch = value("temporal_overlap"), value("batch_size")
        if _is_positive(overlap) and _is_positive(batch) and overlap >= batch:
            note(f"{label}: numz's {numz('temporal_overlap')} = {shown(overlap)} is not smaller "
                 f"than {numz('batch_size')} = {shown(batch)}; numz ran it without overlap, and "
                 f"so does this pack (temporal_overlap = 0)")
            ours["temporal_overlap"] = 0
    if kind == "SeedVR2LoadVAEModel":
        for stage in ("encode", "decode"):
            size, overlap = value(f"{stage}_tile_size"), value(f"{stage}_tile_overlap")
            if _is_positive(overlap) and _is_positive(size) and overlap >= size:
                clamped = max(0, (int(size) // 8 - 1) * 8)
                note(f"{label}: numz's {numz(f'{stage}_tile_overlap')} = {shown(overlap)} is not "
                     f"smaller than {numz(f'{stage}_tile_size')} = {shown(size)}; numz's "
                     f"tiling overlapped {clamped} pixels, and so does this pack")
                ours[f"{stage}_tile_overlap"] = clamped
    return ours


def _out_of_range(value, widget: _Widget) -> bool:
    """A number numz accepts and our input does not (numz's compile cache limits start at 0)."""
    if widget.kind not in ("INT", "FLOAT") or isinstance(value, bool) \
            or not isinstance(value, (int, float)):
        return False
    low, high = widget.extra.get("min"), widget.extra.get("max")
    return low is not None and value < low or high is not None and value > high


def link_field(link, key: str):
    """A field of a saved link: links are ``{"id": ...}`` objects or ``[id, origin, ...]`` lists."""
    if isinstance(link, dict):
        return link.get(key)
    index = LINK_FIELDS.index(key)
    return link[index] if isinstance(link, list) and index < len(link) else None


def _link_id(link):
    return link_field(link, "id")


def _drop_link(links: list, link_id) -> None:
    links[:] = [l for l in links if _link_id(l) != link_id]


def _set_link(links: list, link_id, **changes) -> None:
    for link in (l for l in links if _link_id(l) == link_id):
        if isinstance(link, dict):
            link.update(changes)
        else:
            for key, value in changes.items():
                if LINK_FIELDS.index(key) < len(link):
                    link[LINK_FIELDS.index(key)] = value


def _saved_widget_names(node: dict) -> list:
    """The widget input names the editor of numz's time saved with a node, in widget order."""
    return [inp["widget"]["name"] for inp in node.get("inputs") or []
            if isinstance(inp, dict) and isinstance(inp.get("widget"), dict)
            and inp["widget"].get("name")]


def _translate_node(node: dict, info: dict, links: list, notes: list) -> None:
    """A numz-layout node rewritten to ours in place (values, slots, their links); ours left be."""
    table = NUMZ_NODES[node["type"]]
    values = node.get("widgets_values")
    if not isinstance(values, list):
        return
    widgets = widget_inputs(info)
    by_name = {w.name: w for w in widgets}
    saved = _saved_widget_names(node)
    if saved == [w.name for w in widgets][:len(saved)] and _our_layout(values, widgets):
        return
    layout = saved or list(table.widgets)
    controls = {n for n in layout if n in ("seed", "noise_seed") or
                by_name.get(table.renamed.get(n, n), _Widget(n, "", {})).control}
    read = _read(values, layout, controls)
    if read is None:
        return  # neither layout: the conversion reports the count that does not match
    named, control = read
    label = f"node {node_label(node['id'])} ({node['type']})"
    ours = _as_numz_ran(node["type"], label, _to_ours(label, table, named, by_name, notes),
                        by_name, notes)
    node["widgets_values"] = _editor_values(ours, control, widgets)

    # Input slots: the widget inputs the saved node had as slots, renamed; their links follow.
    our_inputs = {name for name, _ in _inputs(info)}
    saved_inputs = {}
    for inp in node.get("inputs") or []:
        if not isinstance(inp, dict) or "name" not in inp:
            continue
        old = (inp.get("widget") or {}).get("name") or inp["name"]
        if old in table.dropped or table.renamed.get(old, old) not in our_inputs:
            if inp.get("link") is not None:
                notes.append(f"{label}: the link into numz's {old} has no input here; removed")
                _drop_link(links, inp["link"])
            continue
        saved_inputs[table.renamed.get(old, old)] = (old, inp)
    node["inputs"] = _editor_sockets(info, saved_inputs, links)
    for slot, output in enumerate(node.get("outputs") or []):
        if isinstance(output, dict) and slot < len(info.get("output", [])):
            output["type"] = info["output"][slot]
            for link_id in output.get("links") or []:
                _set_link(links, link_id, type=output["type"])


def _editor_values(ours: dict, control: dict, widgets: list[_Widget]) -> list:
    """Widget values in our order, as the editor saves them: ``ours`` by name, our defaults for
    the rest, and after each seed its control value (saved, else the declared one)."""
    values = []
    for widget in widgets:
        values.append(ours.get(widget.name, widget.default))
        if widget.control:
            declared = widget.extra.get(CONTROL_MODE_KEY,
                                        widget.extra.get("control_after_generate"))
            values.append(control.get(widget.name) or (
                declared if declared in CONTROL_VALUES else "randomize"))
    return values


def _translate_graph(graph: dict, object_info: dict, notes: list) -> None:
    links = graph.get("links") or []
    for node in graph["nodes"]:
        if is_ours(node["type"], object_info.get(node["type"])):
            _translate_node(node, object_info[node["type"]], links, notes)
    # A link removed above leaves no end behind on the node it came from.
    kept = {_link_id(l) for l in links}
    for node in graph["nodes"]:
        for output in node.get("outputs") or []:
            if output.get("links"):
                output["links"] = [i for i in output["links"] if i in kept]
    # Links from a numz compile node, or into one of our loaders, keep their old type name when
    # the nodes at either end were ours already; the type is ours on both ends now.
    for link in links:
        if link_field(link, "type") == NUMZ_COMPILE_TYPE:
            _set_link(links, _link_id(link), type=COMPILE_TYPE)


def translate_workflow(workflow: dict, object_info: dict) -> tuple[dict, list[str]]:
    """A copy of an editor workflow, our nodes saved in a numz layout (subgraphs too) in ours, and
    notes on the values left out; malformed: WorkflowError (shape.check_editor_workflow)."""
    check_editor_workflow(workflow)
    try:  # JSON's own copy: fast, and safe at the depth checked (shape.MAX_DEPTH)
        workflow = json.loads(json.dumps(workflow))
    except (TypeError, ValueError) as e:  # a Python caller's object that is no JSON value
        raise WorkflowError(f"not a workflow: {e}") from None
    notes: list[str] = []
    old = _knows_old_nodes(object_info)
    graphs = [workflow, *((workflow.get("definitions") or {}).get("subgraphs") or [])]
    if any(n["type"] in NUMZ_NODES or old and n["type"] in OLD_LAYOUTS
           for g in graphs for n in g["nodes"]):
        for graph in graphs:
            if old:
                _expand_old_graph(graph, object_info, notes)
            _translate_graph(graph, object_info, notes)
    return workflow, notes


def _knows_old_nodes(object_info: dict) -> bool:
    """Can numz v2.0-2.4's nodes become ours (the /object_info has our three nodes)?"""
    return all(is_ours(kind, object_info.get(kind)) for kind in OLD_TARGETS.values())


def translate_prompt(prompt: dict, object_info: dict) -> tuple[dict, list[str]]:
    """A copy of a prompt whose nodes with numz's input names take ours (and our defaults); others
    are left for the validation to name. A value no numz node saved (a list): WorkflowError."""
    notes: list[str] = []
    if not isinstance(prompt, dict) or not any(
            _class_type(n) in (*NUMZ_NODES, *OLD_LAYOUTS) for n in prompt.values()):
        return prompt, notes
    prompt = dict(prompt)
    if _knows_old_nodes(object_info):
        _expand_old_prompt(prompt, object_info, notes)
    for node_id, node in prompt.items():
        kind = _class_type(node)
        info = object_info.get(kind) if kind in NUMZ_NODES else None
        inputs = node.get("inputs") if info is not None else None
        if not isinstance(inputs, dict) or not is_ours(kind, info):
            continue
        table = NUMZ_NODES[kind]
        widgets = {w.name: w for w in widget_inputs(info)}
        if not _numz_prompt_node(table, inputs, widgets):
            continue
        label = f"node {node_label(node_id)} ({kind})"
        links = {k: v for k, v in inputs.items() if is_link(v)}
        values = {k: v for k, v in inputs.items() if not is_link(v)}
        ours = _as_numz_ran(kind, label, _to_ours(label, table, values, widgets, notes), widgets,
                            notes)
        for name, value in links.items():
            if name in table.dropped:
                notes.append(f"{label}: the link into numz's {name} has no input here; removed")
            else:
                ours[table.renamed.get(name, name)] = value
        prompt[node_id] = {**node, "inputs": _with_defaults(ours, info)}
    return prompt, notes


def _class_type(node) -> Optional[str]:
    kind = node.get("class_type") if isinstance(node, dict) else None
    return kind if isinstance(kind, str) else None


def has_numz_nodes(prompt) -> bool:
    """Does an API prompt hold a node in numz's layout (cheap: no /object_info needed)? One of
    numz v2.0-2.4, with numz's input names, or none of ours, or a bool for compile's dynamic."""
    for node in prompt.values() if isinstance(prompt, dict) else ():
        if _class_type(node) in OLD_LAYOUTS:
            return True
        table = NUMZ_NODES.get(_class_type(node))
        inputs = node.get("inputs") if table is not None else None
        if isinstance(inputs, dict) and (_numz_prompt_node(table, inputs, {})
                                         or isinstance(inputs.get("dynamic"), bool)):
            return True
    return False


def _numz_prompt_node(table: NumzNode, inputs: dict, widgets: dict[str, _Widget]) -> bool:
    """numz's input names, none of ours since the first release, or a switch for our choice."""
    return (any(n in inputs for n in (*table.renamed, *table.dropped))
            or bool(table.ours_only) and not any(n in inputs for n in table.ours_only)
            or any(isinstance(v, bool) and n in widgets and widgets[n].choices is not None
                   for n, v in inputs.items()))


# numz v2.0-2.4 (August to early October 2025): one SeedVR2 node held the model and the upscale
# settings; SeedVR2BlockSwap and SeedVR2ExtraArgs fed it their settings through links. Each
# becomes our DiT loader, VAE loader and upscaler, every value on the input of the same meaning.

OLD_UPSCALER, OLD_BLOCKSWAP, OLD_EXTRA_ARGS = "SeedVR2", "SeedVR2BlockSwap", "SeedVR2ExtraArgs"
# Widget inputs in the editor's order, one tuple per release (numz's comfyui_node.py).
OLD_LAYOUTS = {
    OLD_UPSCALER: (
        ("model", "seed", "new_resolution", "batch_size", "preserve_vram", "cache_model",
         "enable_debug", "tiled_vae", "vae_tile_size", "vae_tile_overlap"),  # 2025-08-13
        ("model", "seed", "new_resolution", "batch_size"),  # 2025-08-15
        ("model", "seed", "new_resolution", "batch_size", "color_correction"),  # 2025-09-16
        ("model", "seed", "new_resolution", "batch_size", "color_correction",
         "cond_noise_scale"),  # 2025-09-18
        ("model", "seed", "new_resolution", "batch_size", "color_correction",
         "input_noise_scale", "latent_noise_scale")),  # 2025-09-22 to 2025-10-07
    OLD_BLOCKSWAP: (("blocks_to_swap", "use_non_blocking", "offload_io_components"),
                    ("blocks_to_swap", "offload_io_components")),  # from 2025-09-16
    OLD_EXTRA_ARGS: (("tiled_vae", "vae_tile_size", "vae_tile_overlap", "preserve_vram",
                      "cache_model", "enable_debug", "device"),),
}
OLD_LINKS = {"block_swap_config": OLD_BLOCKSWAP, "extra_args": OLD_EXTRA_ARGS}
# numz input -> the (node, input) pairs here that mean the same: "dit" and "vae" are the loaders
# made for the SeedVR2 node, "upscaler" the node that takes its place.
OLD_INPUTS = {
    "model": (("dit", "model"),), "seed": (("upscaler", "seed"),),
    "new_resolution": (("upscaler", "resolution"),), "batch_size": (("upscaler", "batch_size"),),
    "color_correction": (("upscaler", "color_correction"),),
    "input_noise_scale": (("upscaler", "input_noise_scale"),),
    "latent_noise_scale": (("upscaler", "latent_noise_scale"),),
    "cond_noise_scale": (("upscaler", "latent_noise_scale"),),  # renamed so on 2025-09-22
    "blocks_to_swap": (("dit", "blocks_to_swap"),),
    "offload_io_components": (("dit", "swap_io_components"),),
    "tiled_vae": (("vae", "encode_tiled"), ("vae", "decode_tiled")),
    "vae_tile_size": (("vae", "encode_tile_size"), ("vae", "decode_tile_size")),
    "vae_tile_overlap": (("vae", "encode_tile_overlap"), ("vae", "decode_tile_overlap")),
    "cache_model": (("dit", "cache_model"), ("vae", "cache_model")),
    "device": (("dit", "device"), ("vae", "device")),
    # numz moved both models off the GPU between steps; here each loader's offload_device
    "preserve_vram": (("dit", "offload_device"), ("vae", "offload_device")),
}
OLD_VALUES = {"preserve_vram": {True: "cpu", False: "none"}}
OLD_DROPPED = {"use_non_blocking": False, "enable_debug": False}  # off: nothing is lost
OLD_TARGETS = {"dit": "SeedVR2LoadDiTModel", "vae": "SeedVR2LoadVAEModel",
               "upscaler": "SeedVR2VideoUpscaler"}


def _old_settings(label: str, named: dict, infos: dict, notes: list) -> dict[str, dict]:
    """numz's values by name (SeedVR2's and its config nodes') -> our three nodes'; rest noted."""
    spread: dict[str, dict] = {role: {} for role in OLD_TARGETS}
    for name, value in named.items():
        _check_widget_value(label, name, value)
        if name in OLD_DROPPED and value == OLD_DROPPED[name]:
            continue
        if name not in OLD_INPUTS:
            notes.append(f"{label}: numz's {name} = {shown(value)} has no equivalent in this "
                         f"pack; dropped")
            continue
        for role, target in OLD_INPUTS[name]:
            spread[role][target] = OLD_VALUES[name].get(value, value) \
                if name in OLD_VALUES and isinstance(value, bool) else value
    # numz's BlockSwap of these releases streamed the swapped blocks from the CPU by itself;
    # here the DiT loader names the device the swapped blocks wait on.
    dit = spread["dit"]
    if (_is_positive(dit.get("blocks_to_swap")) or dit.get("swap_io_components") is True) \
            and dit.get("offload_device", "none") == "none":
        dit["offload_device"] = "cpu"
    ours = {}
    for role, values in spread.items():
        widgets = {w.name: w for w in widget_inputs(infos[OLD_TARGETS[role]])}
        numz_names = {target: name for name, pairs in OLD_INPUTS.items()
                      for where, target in pairs if where == role}
        ours[role] = _as_numz_ran(OLD_TARGETS[role], label,
                                  _to_ours(label, NumzNode(()), values, widgets, notes), widgets,
                                  notes, numz_names)
    return ours


def _is_positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _old_layout(node: dict) -> Optional[tuple[dict, dict]]:
    """(values, control values) of an old editor node: by its saved widget names, else count."""
    values = node.get("widgets_values")
    if not isinstance(values, list):
        return None
    saved = _saved_widget_names(node)
    for layout in ((saved,) if saved else OLD_LAYOUTS[node["type"]]):
        read = _read(values, list(layout), {"seed"})
        if read is not None:
            return read
    return None


def _with_defaults(ours: dict, info: dict) -> dict:
    """An API node's inputs: ``ours``, and our default for every other widget input."""
    defaults = {w.name: w.default for w in widget_inputs(info) if w.default is not None}
    return {**defaults, **ours}


def _expand_old_prompt(prompt: dict, object_info: dict, notes: list) -> None:
    """Each SeedVR2 node of an API prompt, in place: our upscaler under its ID, fed by a new DiT
    and VAE loader; the config nodes linked into it are read and removed."""
    next_id = max((int(str(k)) for k in prompt if _is_number_id(k)), default=0) + 1
    consumed = set()
    for node_id, node in list(prompt.items()):
        if _class_type(node) != OLD_UPSCALER:
            continue
        inputs = node.get("inputs") if isinstance(node.get("inputs"), dict) else {}
        named = {k: v for k, v in inputs.items() if not is_link(v)}
        for link_name, kind in OLD_LINKS.items():
            link = inputs.get(link_name)
            source_id = str(link[0]) if is_link(link) else None
            source = prompt.get(source_id)
            if _class_type(source) == kind and isinstance(source.get("inputs"), dict):
                named.update({k: v for k, v in source["inputs"].items() if not is_link(v)})
                consumed.add(source_id)
        ours = _old_settings(f"node {node_label(node_id)} ({OLD_UPSCALER})", named, object_info,
                             notes)
        loaders = {}
        for role in ("dit", "vae"):
            loaders[role], next_id = str(next_id), next_id + 1
            prompt[loaders[role]] = {"class_type": OLD_TARGETS[role], "inputs": _with_defaults(
                ours[role], object_info[OLD_TARGETS[role]])}
        upscaler = _with_defaults(ours["upscaler"], object_info[OLD_TARGETS["upscaler"]])
        upscaler.update(dit=[loaders["dit"], 0], vae=[loaders["vae"], 0])
        if is_link(inputs.get("images")):
            upscaler["image"] = inputs["images"]
        prompt[node_id] = {**node, "class_type": OLD_TARGETS["upscaler"], "inputs": upscaler}
    for node_id in consumed:
        prompt.pop(node_id, None)


def _is_number_id(node_id) -> bool:
    """ASCII digits ("12"; not "²", a digit to ``str.isdigit`` but no number to ``int``)."""
    text = str(node_id)
    return text.isascii() and text.isdigit()


def _count(value) -> int:
    """An editor counter (last_node_id, last_link_id): 0 when it is not a number."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _position(node: dict) -> tuple:
    """A node's (x, y): the editor saves [x, y] (older ones {"0": x, "1": y})."""
    pos = node.get("pos")
    if isinstance(pos, dict):
        pos = [pos.get("0"), pos.get("1")]
    if isinstance(pos, list) and len(pos) >= 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in pos[:2]):
        return pos[0], pos[1]
    return 0, 0


def _expand_old_graph(graph: dict, object_info: dict, notes: list) -> None:
    """Each SeedVR2 node of an editor graph, in place: our upscaler under its ID, fed by a new
    DiT and VAE loader placed above it; the config nodes linked into it are read and removed."""
    nodes, links = graph["nodes"], graph.get("links")
    if links is None:
        links = graph["links"] = []
    by_id = {str(n["id"]): n for n in nodes}  # (unique as text: shape.check_editor_graph)
    next_node = max([_count(graph.get("last_node_id")),
                     *(n["id"] for n in nodes if _count(n["id"]))]) + 1
    next_link = max([_count(graph.get("last_link_id")), *(_link_id(l) for l in links)]) + 1
    consumed = set()
    for node in [n for n in nodes if n["type"] == OLD_UPSCALER]:
        read = _old_layout(node)
        if read is None:
            continue  # no release's layout: the conversion names the node
        named, control = read
        sockets = {}
        for inp in node.get("inputs") or []:
            if inp.get("link") is None:
                continue
            origin = next((link_field(l, "origin_id") for l in links
                           if _link_id(l) == inp["link"]), None)
            source = by_id.get(str(origin))
            if inp["name"] in OLD_LINKS and source is not None \
                    and source["type"] == OLD_LINKS[inp["name"]]:
                config = _old_layout(source)
                named.update(config[0] if config else {})
                consumed.add(str(source["id"]))
                _drop_link(links, inp["link"])
            elif inp.get("name") == "images":
                sockets["image"] = inp["link"]
        ours = _old_settings(f"node {node_label(node['id'])} ({OLD_UPSCALER})", named,
                             object_info, notes)
        x, y = _position(node)
        for offset, role in enumerate(("dit", "vae")):
            info = object_info[OLD_TARGETS[role]]
            nodes.append({"id": next_node, "type": OLD_TARGETS[role],
                          "pos": [x - 400, y + 300 * offset], "size": [300, 250], "flags": {},
                          "order": 0, "mode": 0, "inputs": _editor_sockets(info, {}, links),
                          "outputs": [{"name": info["output"][0], "type": info["output"][0],
                                       "links": [next_link]}],
                          "properties": {"Node name for S&R": OLD_TARGETS[role]},
                          "widgets_values": _editor_values(ours[role], {}, widget_inputs(info))})
            links.append([next_link, next_node, 0, node["id"], 0, info["output"][0]])
            sockets[role] = next_link
            next_node, next_link = next_node + 1, next_link + 1
        info = object_info[OLD_TARGETS["upscaler"]]
        node["type"] = OLD_TARGETS["upscaler"]
        slots = {name: (name, {"name": name, "type": None, "link": link})
                 for name, link in sockets.items()}
        node["inputs"] = _editor_sockets(info, slots, links)
        node["widgets_values"] = _editor_values(ours["upscaler"], control, widget_inputs(info))
        if not isinstance(node.get("properties"), dict):
            node["properties"] = {}
        node["properties"]["Node name for S&R"] = OLD_TARGETS["upscaler"]
    graph["nodes"] = [n for n in nodes if str(n["id"]) not in consumed]
    graph["last_node_id"], graph["last_link_id"] = next_node - 1, next_link - 1


def _editor_sockets(info: dict, saved: dict, links: list) -> list:
    """A node's input slots in our order: its sockets, and the widget inputs given as slots;
    ``saved``: our input name -> (its saved name, the saved slot). Links follow their inputs."""
    widgets = {w.name for w in widget_inputs(info)}
    slots = []
    for name, spec in _inputs(info):
        kind = "COMBO" if isinstance(spec[0], list) else spec[0]
        old, entry = saved.get(name, (name, None))
        if entry is None:
            if name in widgets:
                continue
            entry = {"name": name, "type": kind, "link": None}
        else:
            entry = {**entry, "name": name, "type": kind}
            for key in ("localized_name", "label"):  # the editor shows these; numz's name
                if entry.get(key) == old:
                    entry[key] = name
            if name in widgets:
                entry["widget"] = {**(entry.get("widget") or {}), "name": name}
        if entry.get("link") is not None:
            _set_link(links, entry["link"], target_slot=len(slots), type=kind)
        slots.append(entry)
    return slots
