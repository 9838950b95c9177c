"""UI-format (editor) workflow -> API-format prompt, ``/object_info`` (a server's, or ours) naming
the widget values in order; our nodes saved by the numz pack take our layout first (:mod:`.numz`).
Extra values, frontend-only, muted and bypassed nodes: docs/comfyui.md ("Without the editor")."""

from __future__ import annotations

from typing import Callable, Optional

from .errors import WorkflowError
from .numz import LINK_FIELDS, link_field, read_widget_values, translate_workflow, widget_inputs
from .server import UPLOAD_FLAGS
from .shape import node_label, shown

FRONTEND_ONLY = ("Note", "MarkdownNote", "Reroute", "PrimitiveNode")
MUTED, BYPASSED = 2, 4


def is_ui_format(workflow) -> bool:
    return isinstance(workflow, dict) and isinstance(workflow.get("nodes"), list)


def _map_widget_values(node: dict, info: dict) -> dict:
    values = node.get("widgets_values")
    widgets = widget_inputs(info)
    if values is None:
        return {}
    if isinstance(values, dict):  # some nodes save widgets by name
        return {w.name: values[w.name] for w in widgets if w.name in values}
    if not isinstance(values, list):
        raise WorkflowError("widgets_values must be a list", node_label(node.get("id")),
                            node.get("type"))
    # A workflow saved before later inputs existed has fewer values: those take their defaults.
    pairs, _, i = read_widget_values(values, [w.name for w in widgets],
                                     {w.name for w in widgets if w.control})
    has_upload = any(w.extra.get(flag) for w in widgets for flag in UPLOAD_FLAGS)
    if has_upload and i == len(values) - 1:
        i += 1
    if i < len(values):
        raise WorkflowError(f"{len(values)} widget values for the {len(widgets)} widgets "
                            f"{[w.name for w in widgets]}; the workflow was saved with a different "
                            f"version of this node", node_label(node.get("id")), node.get("type"))
    return dict(pairs)


def _links(workflow: dict) -> dict:
    """link id -> (origin node, origin slot, target node, target slot, type), shapes checked."""
    return {link_field(link, "id"): tuple(link_field(link, key) for key in LINK_FIELDS[1:])
            for link in workflow.get("links") or []}


def _slot_type(node: dict, slot: int):
    outputs = node.get("outputs") or []
    return outputs[slot].get("type") if slot < len(outputs) else None


def ui_to_api(workflow: dict, object_info: dict,
              warn: Optional[Callable[[str], None]] = None) -> dict:
    """An editor workflow as a prompt; ``warn`` gets a note per numz-layout value with no place."""
    workflow, notes = translate_workflow(workflow, object_info)  # (checks its shape first)
    for note in notes if warn is not None else ():
        warn(note)
    nodes = {str(node["id"]): node for node in workflow["nodes"]}  # ids are unique as text
    links = _links(workflow)
    subgraphs = {g["id"] for g in (workflow.get("definitions") or {}).get("subgraphs") or []}
    prompt = {}
    for node_id, node in nodes.items():
        kind = node["type"]
        if kind in FRONTEND_ONLY or node.get("mode") in (MUTED, BYPASSED):
            continue
        if kind in subgraphs:
            raise WorkflowError("subgraphs are not supported: unpack the subgraph into nodes "
                                "in the editor", node_label(node_id), kind)
        info = object_info.get(kind)
        if info is None:
            raise WorkflowError(f"unknown node type {kind!r} (not one of our nodes, nor a core "
                                f"node this runner provides; run it with --server against a "
                                f"ComfyUI that has it)", node_label(node_id), kind)
        inputs = _map_widget_values(node, info)
        for inp in node.get("inputs") or []:
            if inp.get("link") is None:
                continue
            source = _source_of(node_id, inp["link"], nodes, links)
            name = (inp.get("widget") or {}).get("name") or inp["name"]
            if source is None:
                inputs.pop(name, None)
            else:
                inputs[name] = source[1] if isinstance(source, tuple) else source
        title = node.get("title") or info.get("display_name") or kind
        prompt[node_id] = {"inputs": inputs, "class_type": kind, "_meta": {"title": title}}
    return prompt


def _source_of(node_id: str, link_id, nodes: dict, links: dict):
    """What a link into ``node_id`` carries: [node id, slot], ("literal", value) from a
    PrimitiveNode, or None (muted). Reroutes and bypassed nodes are followed in a loop."""
    seen = set()
    while True:
        if link_id not in links:
            raise WorkflowError(f"link {shown(link_id)} is missing from the workflow's links",
                                node_label(node_id), nodes[node_id]["type"])
        origin, slot, _, _, kind = links[link_id]
        origin = str(origin)
        node = nodes.get(origin)
        if node is None:
            raise WorkflowError(f"link {shown(link_id)} comes from node {node_label(origin)}, "
                                f"which does not exist", node_label(node_id),
                                nodes[node_id]["type"])
        if origin in seen:
            raise WorkflowError(f"link {shown(link_id)}: Reroute/bypass nodes form a loop",
                                node_label(node_id), nodes[node_id]["type"])
        seen.add(origin)
        if node["type"] == "Reroute" or node.get("mode") == BYPASSED:
            wanted = kind or _slot_type(node, slot)
            link_id = next((inp["link"] for inp in node.get("inputs") or []
                            if inp.get("link") is not None and (
                                node["type"] == "Reroute" or inp.get("type") in (wanted, "*"))),
                           None)
            if link_id is None:
                return None
            continue
        if node["type"] == "PrimitiveNode":
            values = node.get("widgets_values")
            return ("literal", values[0] if isinstance(values, list) and values else None)
        if node.get("mode") == MUTED:
            return None
        return [origin, slot]
