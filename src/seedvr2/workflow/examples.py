"""The example workflows in ``example_workflows/``, described once and written in both formats.

Each example is a small graph (:class:`Example`); :func:`ui_workflow` writes what the editor
saves (nodes with positions, links, widget values in widget order -- including the editor's
extra values after a seed and a file upload) and :func:`api_prompt` the API format. A test
checks that the committed files are exactly what this module writes, and that converting each
UI file with :mod:`.convert` gives its API twin.

    python -m seedvr2.workflow.examples [FOLDER]    # rewrite the examples (after node changes)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

EXAMPLE_IMAGE, EXAMPLE_VIDEO = "seedvr2_example.png", "seedvr2_example.mp4"
DIT_FP16, DIT_GGUF, VAE = ("seedvr2_ema_3b_fp16.safetensors", "seedvr2_ema_3b-Q4_K_M.gguf",
                           "ema_vae_fp16.safetensors")


@dataclass
class ExampleNode:
    id: int
    type: str
    pos: tuple
    values: dict = field(default_factory=dict)  # widget values differing from the defaults
    links: dict = field(default_factory=dict)  # input name -> (source node id, output index)
    title: Optional[str] = None


@dataclass
class Example:
    name: str
    description: str
    nodes: list


def _loaders(dit_values=None, vae_values=None, x=40, y=260) -> list:
    return [ExampleNode(2, "SeedVR2LoadDiTModel", (x, y), {"model": DIT_FP16, **(dit_values or {})}),
            ExampleNode(3, "SeedVR2LoadVAEModel", (x, y + 380), {"model": VAE, **(vae_values or {})})]


def _video_graph(upscaler_values: dict, prefix: str, **loader_values) -> list:
    return [
        ExampleNode(1, "LoadVideo", (40, 40), {"file": EXAMPLE_VIDEO}),
        ExampleNode(6, "GetVideoComponents", (400, 40), links={"video": (1, 0)}),
        *_loaders(**loader_values),
        ExampleNode(4, "SeedVR2VideoUpscaler", (460, 260), upscaler_values,
                    links={"image": (6, 0), "dit": (2, 0), "vae": (3, 0)}),
        ExampleNode(7, "CreateVideo", (880, 260), links={"images": (4, 0), "fps": (6, 2),
                                                        "audio": (6, 1)}),
        ExampleNode(5, "SaveVideo", (1180, 260), {"filename_prefix": prefix},
                    links={"video": (7, 0)}),
    ]


EXAMPLES = [
    Example("image_upscale", "One image: Load Image -> SeedVR2 -> Save Image.", [
        ExampleNode(1, "LoadImage", (40, 40), {"image": EXAMPLE_IMAGE}),
        *_loaders(),
        ExampleNode(4, "SeedVR2VideoUpscaler", (460, 260), {"batch_size": 1, "resolution": 1080},
                    links={"image": (1, 0), "dit": (2, 0), "vae": (3, 0)}),
        ExampleNode(5, "SaveImage", (880, 260), {"filename_prefix": "SeedVR2/image"},
                    links={"images": (4, 0)}),
    ]),
    Example("video_upscale", "A video with its audio: Load Video -> frames -> SeedVR2 -> "
            "Create Video (same fps and audio) -> Save Video.",
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
        *_loaders(x=40, y=40),
        ExampleNode(4, "SeedVR2UpscaleVideoFile", (460, 40),
                    {"video_path": EXAMPLE_VIDEO, "filename_prefix": "SeedVR2/file",
                     "batch_size": 21, "resolution": 1080, "temporal_overlap": 2},
                    links={"dit": (2, 0), "vae": (3, 0)}),
        ExampleNode(5, "PreviewImage", (900, 40), links={"images": (4, 1)}),
    ]),
]


def _definitions() -> dict:
    from .execute import registry

    return registry()


def _widget_value(inp, values: dict):
    return values.get(inp.name, inp.default)


def api_prompt(example: Example) -> dict:
    nodes = _definitions()
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
    nodes = _definitions()
    order = _order(example)
    links, ui_nodes = [], []
    by_id = {n.id: n for n in example.nodes}
    outgoing: dict = {}
    def socket_inputs(node):
        """Sockets, then widgets fed by a link (the editor's order for converted widgets)."""
        inputs = nodes[node.type].inputs
        return [i for i in inputs if not i.is_widget] + \
            [i for i in inputs if i.is_widget and i.name in node.links]

    for node in sorted(example.nodes, key=lambda n: n.id):
        for slot, inp in enumerate(socket_inputs(node)):
            if inp.name in node.links:
                source, source_slot = node.links[inp.name]
                link_id = len(links) + 1
                kind = nodes[by_id[source].type].outputs[source_slot].type
                links.append([link_id, source, source_slot, node.id, slot, kind])
                outgoing.setdefault((source, source_slot), []).append(link_id)
    for node in sorted(example.nodes, key=lambda n: n.id):
        definition = nodes[node.type]
        sockets = socket_inputs(node)
        widgets_values = []
        for inp in definition.inputs:
            if not inp.is_widget:
                continue
            widgets_values.append(_widget_value(inp, node.values))
            if inp.control_after_generate:
                widgets_values.append("fixed")
            if inp.upload:
                widgets_values.append("image")
        inputs = []
        for slot, inp in enumerate(sockets):
            link = next((l[0] for l in links if l[3] == node.id and l[4] == slot), None)
            entry = {"name": inp.name, "type": inp.type, "link": link}
            if inp.is_widget:
                entry["widget"] = {"name": inp.name}
            if inp.optional:
                entry["shape"] = 7  # the editor draws optional sockets hollow
            inputs.append(entry)
        outputs = [{"name": out.name, "type": out.type,
                    "links": outgoing.get((node.id, slot), []), "slot_index": slot}
                   for slot, out in enumerate(definition.outputs)]
        widgets = len(widgets_values)
        ui_nodes.append({
            "id": node.id, "type": node.type, "pos": list(node.pos),
            "size": [360 if node.type.startswith("SeedVR2") else 300,
                     max(60, 30 + 24 * (len(sockets) + max(len(outputs), 0) + widgets))],
            "flags": {}, "order": order[node.id], "mode": 0, "inputs": inputs,
            "outputs": outputs, "properties": {"Node name for S&R": node.type},
            "widgets_values": widgets_values,
            **({"title": node.title} if node.title else {}),
        })
    return {"last_node_id": max(n.id for n in example.nodes), "last_link_id": len(links),
            "nodes": ui_nodes, "links": links, "groups": [], "config": {},
            "extra": {"ds": {"scale": 1.0, "offset": [0, 0]}, "info": {
                "name": example.name, "description": example.description}},
            "version": 0.4}


def dumps(workflow: dict) -> str:
    return json.dumps(workflow, indent=2) + "\n"


def files() -> dict[str, str]:
    """File name -> contents of every example, UI format and API twin."""
    out = {}
    for example in EXAMPLES:
        out[f"{example.name}.json"] = dumps(ui_workflow(example))
        out[f"{example.name}_api.json"] = dumps(api_prompt(example))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else Path(__file__).resolve().parents[3] / "example_workflows")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files().items():
        (folder / name).write_text(text)
        print(folder / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
