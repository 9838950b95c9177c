"""The example workflows in ``example_workflows/``, described once and written in both formats.

Each example is a small graph (:class:`Example`, its nodes in layout columns): :func:`ui_workflow`
writes what the editor saves, :func:`api_prompt` its API twin into ``api/`` (docs/comfyui.md,
"Example workflows"). ``scripts/gen_examples.py`` writes the files and the thumbnails; tests
check the committed files are what this module writes, and that converting each UI file gives
its API twin. A development tool beside its generator (the library never reads it; the
published archive leaves ``scripts/`` out): ComfyUI reads the written files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Optional

from seedvr2.workflow.execute import registry

EXAMPLE_IMAGE, EXAMPLE_VIDEO = "example.png", "seedvr2_example.mp4"  # example.png: stock ComfyUI's
DIT_FP16, DIT_GGUF, VAE = ("seedvr2_ema_3b_fp16.safetensors", "seedvr2_ema_3b-Q4_K_M.gguf",
                           "ema_vae_fp16.safetensors")
API_FOLDER = "api"  # example_workflows/api/: ComfyUI lists only example_workflows/*.json as templates


@dataclass
class ExampleNode:
    id: int
    type: str
    values: dict = field(default_factory=dict)  # widget values differing from the defaults
    links: dict = field(default_factory=dict)  # input name -> (source node id, output index)
    title: Optional[str] = None


@dataclass
class Example:
    name: str
    description: str
    columns: list  # of lists of ExampleNode: the layout, left to right, each column top down

    @property
    def nodes(self) -> list:
        return [node for column in self.columns for node in column]


def _loaders(dit_values=None, vae_values=None) -> list:
    return [ExampleNode(2, "SeedVR2LoadDiTModel", {"model": DIT_FP16, **(dit_values or {})}),
            ExampleNode(3, "SeedVR2LoadVAEModel", {"model": VAE, **(vae_values or {})})]


def _video_graph(upscaler_values: dict, prefix: str, **loader_values) -> list:
    return [
        [ExampleNode(1, "LoadVideo", {"file": EXAMPLE_VIDEO})],
        _loaders(**loader_values),
        [ExampleNode(4, "SeedVR2UpscaleVideo", upscaler_values,
                     links={"video": (1, 0), "dit": (2, 0), "vae": (3, 0)})],
        [ExampleNode(5, "SaveVideo", {"filename_prefix": prefix}, links={"video": (4, 0)})],
    ]


EXAMPLES = [
    Example("image_upscale", "One image: Load Image -> SeedVR2 -> Save Image.", [
        [ExampleNode(1, "LoadImage", {"image": EXAMPLE_IMAGE})],
        _loaders(),
        [ExampleNode(4, "SeedVR2VideoUpscaler", {"batch_size": 1, "resolution": 1080},
                     links={"image": (1, 0), "dit": (2, 0), "vae": (3, 0)})],
        [ExampleNode(5, "SaveImage", {"filename_prefix": "SeedVR2/image"},
                     links={"images": (4, 0)})],
    ]),
    Example("video_upscale", "A video with its audio and frame rate: Load Video -> SeedVR2 "
            "Upscale Video (streams the file) -> Save Video.",
            _video_graph({"batch_size": 21, "resolution": 720, "temporal_overlap": 2},
                         "SeedVR2/video")),
    Example("low_vram_video", "Low VRAM: GGUF DiT with BlockSwap, models offloaded to the CPU "
            "between phases, tiled VAE encode and decode.",
            _video_graph({"batch_size": 9, "resolution": 720, "temporal_overlap": 2},
                         "SeedVR2/low_vram",
                         dit_values={"model": DIT_GGUF, "offload_device": "cpu",
                                     "blocks_to_swap": 16, "swap_io_components": True},
                         vae_values={"offload_device": "cpu", "encode_tiled": True,
                                     "decode_tiled": True})),
    Example("multi_gpu_video", "Multi-GPU: devices auto splits the batches over every visible "
            "GPU (one device works too).",
            _video_graph({"batch_size": 21, "resolution": 1080, "temporal_overlap": 2,
                          "devices": "auto"}, "SeedVR2/multi_gpu")),
    Example("video_file_streaming", "Any length or resolution: the video file is upscaled to a "
            "new file frame batch by frame batch (never one IMAGE batch in RAM); audio kept.", [
        _loaders(),
        [ExampleNode(4, "SeedVR2UpscaleVideoFile",
                     {"video_path": EXAMPLE_VIDEO, "filename_prefix": "SeedVR2/file",
                      "batch_size": 21, "resolution": 1080, "temporal_overlap": 2},
                     links={"dit": (2, 0), "vae": (3, 0)})],
        [ExampleNode(5, "PreviewImage", links={"images": (4, 1)})],
    ]),
]


# ---------------------------------------------------------------------------------------------
# Layout: node sizes as the editor (ComfyUI frontend 1.32) computes them, so a saved node is
# exactly as tall as its widgets, and room for what the editor draws on a node besides (the
# picked image or video of a loader, the result of a save node).

TITLE_HEIGHT = 30  # drawn above a node's pos
SLOT_HEIGHT, WIDGET_HEIGHT = 20, 24  # a socket row; a widget with its spacing
WIDTH = {"SeedVR2": 340, "core": 300}
# Height the editor adds below the widgets of a node that shows its input file (picture or
# player, as wide as the node): room for a square one; the editor grows a node that is
# shorter, and keeps a taller one as saved.
PREVIEW_ROOM = {"LoadImage": 310, "LoadVideo": 310, "SeedVR2UpscaleVideoFile": 350}
# Room left below a node that shows a result after a run (Save Image / Video, Preview Image,
# our file node's player): nothing is placed under it in its column.
GAP_X, GAP_Y = 60, 50
# The view a workflow opens with: the whole graph fits a 1280 x 720 editor canvas clear of its
# side bar (left, 59 px) and of its tab bar, workflow menu and Run bar (top, to 130 px).
VIEW_SIZE, VIEW_MARGINS = (1280, 720), (80, 150, 30, 30)  # left, top, right, bottom


def _widget_value(inp, values: dict):
    return values.get(inp.name, inp.default)


def editor_values(definition, values: dict) -> list:
    """The widget values the editor saves for a node, one per widget it shows: each widget
    input's (``values``, else the default), after a seed its "control after generate" mode, and
    last the upload button's for a node with a file to upload."""
    saved = []
    for inp in definition.inputs:
        if inp.is_widget:
            saved.append(_widget_value(inp, values))
            if inp.control_after_generate:
                saved.append(inp.control_after_generate)
    return saved + (["image"] if any(inp.upload for inp in definition.inputs) else [])


def node_size(node: ExampleNode, definition) -> list:
    sockets = sum(1 for i in definition.inputs if not i.is_widget)
    rows = max(sockets, len(definition.outputs), 1)
    widgets = len(editor_values(definition, {}))
    height = rows * SLOT_HEIGHT + 6 + (8 + WIDGET_HEIGHT * widgets if widgets else 0)
    height += PREVIEW_ROOM.get(node.type, 0)
    return [WIDTH["SeedVR2" if node.type.startswith("SeedVR2") else "core"], height]


def layout(example: Example, nodes: dict) -> dict:
    """node id -> (pos, size): columns left to right, each top down."""
    placed, x = {}, 0
    for column in example.columns:
        y = TITLE_HEIGHT
        for node in column:
            size = node_size(node, nodes[node.type])
            placed[node.id] = ([x, y], size)
            y += size[1] + GAP_Y + TITLE_HEIGHT
        x += max(placed[n.id][1][0] for n in column) + GAP_X
    return placed


def initial_view(placed: dict) -> dict:
    """The editor's saved view (extra.ds): the whole graph in VIEW_SIZE, clear of the bars."""
    left = min(pos[0] for pos, _ in placed.values())
    top = min(pos[1] - TITLE_HEIGHT for pos, _ in placed.values())
    right = max(pos[0] + size[0] for pos, size in placed.values())
    bottom = max(pos[1] + size[1] for pos, size in placed.values())
    m_left, m_top, m_right, m_bottom = VIEW_MARGINS
    room = (VIEW_SIZE[0] - m_left - m_right, VIEW_SIZE[1] - m_top - m_bottom)
    scale = round(min(1.0, room[0] / (right - left), room[1] / (bottom - top)), 2)
    # screen = (graph + offset) * scale
    return {"scale": scale, "offset": [round(m_left / scale - left, 1),
                                       round(m_top / scale - top, 1)]}


def api_prompt(example: Example) -> dict:
    nodes = registry()
    prompt = {}
    for node in sorted(example.nodes, key=lambda n: n.id):
        definition = nodes[node.type]
        inputs = {}
        for inp in definition.inputs:
            if inp.name in node.links:
                source, slot = node.links[inp.name]
                inputs[inp.name] = [str(source), slot]
            elif inp.is_widget:
                inputs[inp.name] = _widget_value(inp, node.values)
        prompt[str(node.id)] = {"inputs": inputs, "class_type": node.type,
                                "_meta": {"title": node.title or definition.display_name}}
    return prompt


def _order(example: Example) -> dict:
    done: dict = {}

    def visit(node):
        if node.id not in done:
            for source, _ in node.links.values():
                visit(next(n for n in example.nodes if n.id == source))
            done[node.id] = len(done)
    for node in example.nodes:
        visit(node)
    return done


def ui_workflow(example: Example) -> dict:
    nodes = registry()
    order = _order(example)
    placed = layout(example, nodes)
    links, ui_nodes = [], []
    by_id = {n.id: n for n in example.nodes}
    outgoing: dict = {}  # (node id, output slot) -> link ids, filled as later nodes link to it
    for node in sorted(example.nodes, key=lambda n: n.id):
        definition = nodes[node.type]
        # Sockets, then widgets fed by a link (the editor's order for converted widgets).
        sockets = [i for i in definition.inputs if not i.is_widget] + \
            [i for i in definition.inputs if i.is_widget and i.name in node.links]
        inputs = []
        for slot, inp in enumerate(sockets):
            link = None
            if inp.name in node.links:
                source, source_slot = node.links[inp.name]
                link = len(links) + 1
                kind = nodes[by_id[source].type].outputs[source_slot].type
                links.append([link, source, source_slot, node.id, slot, kind])
                outgoing.setdefault((source, source_slot), []).append(link)
            entry = {"name": inp.name, "type": inp.type, "link": link}
            if inp.is_widget:
                entry["widget"] = {"name": inp.name}
            if inp.optional:
                entry["shape"] = 7  # the editor draws optional sockets hollow
            inputs.append(entry)
        outputs = [{"name": out.name, "type": out.type,
                    "links": outgoing.setdefault((node.id, slot), []), "slot_index": slot}
                   for slot, out in enumerate(definition.outputs)]
        pos, size = placed[node.id]
        ui_nodes.append({
            "id": node.id, "type": node.type, "pos": pos, "size": size,
            "flags": {}, "order": order[node.id], "mode": 0, "inputs": inputs,
            "outputs": outputs, "properties": {"Node name for S&R": node.type,
                                               **_declared_models(definition, node.values)},
            "widgets_values": editor_values(definition, node.values),
            **({"title": node.title} if node.title else {}),
        })
    return {"last_node_id": max(n.id for n in example.nodes), "last_link_id": len(links),
            "nodes": ui_nodes, "links": links, "groups": [], "config": {},
            "extra": {"ds": initial_view(placed), "info": {
                "name": example.name, "description": example.description}},
            "version": 0.4}


def _declared_models(definition, values: dict) -> dict:
    """``properties.models`` for a node whose widgets name registered model files: what the
    editor's missing-models dialog reads (name, download URL, models/ folder) to offer each
    download the user lacks."""
    from seedvr2.loading.registry import KNOWN_FILES, download_url

    names = [v for v in (_widget_value(i, values) for i in definition.inputs if i.is_widget)
             if isinstance(v, str) and v in KNOWN_FILES]
    if not names:
        return {}
    return {"models": [{"name": n, "url": download_url(n),
                        "directory": KNOWN_FILES[n].comfy_folder} for n in names]}


def dumps(workflow: dict) -> str:
    return json.dumps(workflow, indent=2) + "\n"


def files() -> dict[str, str]:
    """Path in example_workflows/ -> contents of every example: the editor's format beside
    (the templates ComfyUI lists), the API twin in api/ (ComfyUI does not look there)."""
    out = {}
    for example in EXAMPLES:
        out[f"{example.name}.json"] = dumps(ui_workflow(example))
        out[f"{API_FOLDER}/{example.name}.json"] = dumps(api_prompt(example))
    return out


# ---------------------------------------------------------------------------------------------
# Thumbnails: <name>.jpg beside each template, the picture the Templates browser shows, written by
# scripts/gen_examples.py --thumbnails (the result of running the workflow).

THUMB_WIDTH = 320


def thumbnail_stamp(example: Example) -> str:
    """What a thumbnail records (its JPEG comment) of the workflow it pictures: the example
    and a digest of its API prompt, so a test finds thumbnails older than their workflow."""
    digest = hashlib.sha256(dumps(api_prompt(example)).encode()).hexdigest()[:16]
    return f"seedvr2 example {example.name} {digest}"
