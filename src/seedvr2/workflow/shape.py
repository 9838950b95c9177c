"""The shape of a workflow, checked once where it enters (``run-workflow``, the UI -> API
conversion, the numz rewriting): after it readers may trust every field they read, and every
malformed field is one :class:`WorkflowError` naming its node. Nothing here recurses: values are
walked with a list, and one nested past :data:`MAX_DEPTH` levels (far past any saved workflow;
Python's recursion limit is a few hundred further) is refused, so later readers may recurse."""

from __future__ import annotations

import reprlib
from typing import Optional

from .errors import WorkflowError

MAX_DEPTH = 100  # JSON levels (objects and arrays) in a workflow or prompt
# Python refuses to turn an int of more than 4300 digits into text (sys.int_max_str_digits):
# such a number could be neither shown nor saved.
MAX_INT_BITS = 14_000

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlevel = 60, 60, 3
_repr.maxlist = _repr.maxdict = _repr.maxtuple = 4


def shown(value) -> str:
    """``value`` for a message: short, whatever its size or depth."""
    if isinstance(value, int) and not isinstance(value, bool) and \
            abs(value).bit_length() > 1000:
        return f"<a number of about {int(abs(value).bit_length() * 0.30103)} digits>"
    try:
        return _repr.repr(value)
    except (ValueError, RecursionError):  # (a huge int deeper inside)
        return f"<{type(value).__name__}>"


def node_label(node_id) -> str:
    """A node id as messages show it: ``4``, or its repr when it is odd (empty, long, ...)."""
    text = str(node_id) if is_node_id(node_id) else ""
    return text if text and len(text) <= 40 and text.isprintable() and text.strip() == text \
        else shown(node_id)


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def is_node_id(value) -> bool:
    """A node id as the editor or a prompt writes it: a number or a string."""
    return isinstance(value, str) or isinstance(value, int) and not isinstance(value, bool)


def is_link_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def nesting_problem(value) -> Optional[str]:
    """What makes ``value`` unreadable (too deep, a number too long to write), or None."""
    level, items = 0, [value]
    while items:
        if level > MAX_DEPTH:
            return f"nests values more than {MAX_DEPTH} levels deep: not something a workflow holds"
        inner = []
        for item in items:
            if isinstance(item, dict):
                inner.extend(item.values())
            elif isinstance(item, list):
                inner.extend(item)
            elif isinstance(item, int) and abs(item).bit_length() > MAX_INT_BITS:
                return f"holds {shown(item)}: numbers past 4000 digits cannot be read"
        items, level = inner, level + 1
    return None


def _node_error(node: dict, index: int, message: str) -> WorkflowError:
    node_id = node.get("id")
    kind = node.get("type")
    label = node_label(node_id) if is_node_id(node_id) else f"#{index + 1} of the nodes list"
    return WorkflowError(message, label, kind if isinstance(kind, str) else "?")


def _check_slots(node: dict, index: int, key: str, check_entry) -> None:
    slots = node.get(key)
    if slots is None:
        return
    if not isinstance(slots, list):
        raise _node_error(node, index, f"'{key}' must be a list of slots, not "
                                       f"{_kind(slots)} ({shown(slots)})")
    for slot, entry in enumerate(slots):
        if not isinstance(entry, dict):
            raise _node_error(node, index, f"{key}[{slot}] must be an object, not "
                                           f"{_kind(entry)} ({shown(entry)})")
        problem = check_entry(entry)
        if problem:
            raise _node_error(node, index, f"{key}[{slot}] ({shown(entry.get('name'))}): "
                                           f"{problem}")


def _input_problem(entry: dict) -> Optional[str]:
    if not isinstance(entry.get("name"), str):
        return f"its name must be a string, not {_kind(entry.get('name'))}"
    link = entry.get("link")
    if link is not None and not is_link_id(link):
        return f"its link must be a link id (a number) or null, not {shown(link)}"
    widget = entry.get("widget")
    if widget is not None and not (isinstance(widget, dict) and
                                   isinstance(widget.get("name", ""), str)):
        return f"its widget must be an object with a name, not {shown(widget)}"
    return None


def _output_problem(entry: dict) -> Optional[str]:
    links = entry.get("links")
    if links is not None and not (isinstance(links, list) and all(map(is_link_id, links))):
        return f"its links must be a list of link ids, not {shown(links)}"
    return None


def _check_node(node, index: int) -> None:
    if not isinstance(node, dict):
        raise WorkflowError(f"#{index + 1} of the nodes list is not a node (an object with id "
                            f"and type): {shown(node)}")
    if "id" not in node or "type" not in node:
        raise _node_error(node, index, "malformed node: expected id and type")
    if not is_node_id(node["id"]):
        raise _node_error(node, index, f"its id {shown(node['id'])} is {_kind(node['id'])}; a "
                                       f"node id is a number or a string")
    if not isinstance(node["type"], str):
        raise _node_error(node, index, f"its type {shown(node['type'])} is "
                                       f"{_kind(node['type'])}; a node type is a name (a string)")
    mode = node.get("mode", 0)
    if mode is not None and not (isinstance(mode, int) and not isinstance(mode, bool)):
        raise _node_error(node, index, f"its mode {shown(mode)} is not a number (0 runs, 2 is "
                                       f"muted, 4 bypassed)")
    values = node.get("widgets_values")
    if values is not None and not isinstance(values, (list, dict)):
        raise _node_error(node, index, f"widgets_values must be a list, not {_kind(values)} "
                                       f"({shown(values)})")
    _check_slots(node, index, "inputs", _input_problem)
    _check_slots(node, index, "outputs", _output_problem)
    for key, value in node.items():
        problem = nesting_problem(value)
        if problem:
            raise _node_error(node, index, f"{shown(key)} {problem}")


LINK_FIELDS = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")


def _check_link(link, nodes: dict) -> None:
    """A malformed link is its target's error when in ``nodes`` (id text -> (index, node))."""
    fields = (dict(zip(LINK_FIELDS, link)) if isinstance(link, list)
              else link if isinstance(link, dict) else {})
    ok = (not isinstance(link, list) or len(link) >= 5) and is_link_id(fields.get("id")) and \
        is_node_id(fields.get("origin_id")) and is_node_id(fields.get("target_id")) and \
        is_index(fields.get("origin_slot")) and is_index(fields.get("target_slot"))
    if ok:
        return
    message = (f"malformed link {shown(link)}: expected [id, origin node, output slot, target "
               f"node, input slot, type]")
    target = fields.get("target_id")
    if is_node_id(target) and str(target) in nodes:
        raise _node_error(nodes[str(target)][1], nodes[str(target)][0], message)
    raise WorkflowError(message)


def check_editor_graph(graph, where: str = "the workflow") -> None:
    """An editor graph (the workflow or a subgraph): nodes and links as saved, ids unique."""
    if not isinstance(graph, dict) or not isinstance(graph.get("nodes"), list):
        raise WorkflowError(f"{where}: expected an object with a list of nodes, not "
                            f"{shown(graph)}")
    seen = {}  # node id as text -> (index, node)
    for index, node in enumerate(graph["nodes"]):
        _check_node(node, index)
        key = str(node["id"])
        if key in seen:
            raise _node_error(node, index, f"two nodes have the id {shown(node['id'])} "
                                           f"(#{seen[key][0] + 1} and #{index + 1} of {where}'s "
                                           f"nodes)")
        seen[key] = (index, node)
    links = graph.get("links")
    if links is not None and not isinstance(links, list):
        raise WorkflowError(f"{where}: 'links' must be a list, not {shown(links)}")
    ids = set()
    for link in links or ():
        _check_link(link, seen)
        link_id = link[0] if isinstance(link, list) else link["id"]
        if link_id in ids:
            raise WorkflowError(f"{where}: two links have the id {shown(link_id)}")
        ids.add(link_id)
    for key, value in graph.items():
        problem = nesting_problem(value) if key not in ("nodes", "definitions") else None
        if problem:
            raise WorkflowError(f"{where}: {shown(key)} {problem}")


def check_editor_workflow(workflow) -> None:
    """An editor workflow and its subgraph definitions."""
    check_editor_graph(workflow)
    definitions = workflow.get("definitions")
    if definitions is None:
        return
    subgraphs = definitions.get("subgraphs") if isinstance(definitions, dict) else None
    if not isinstance(definitions, dict) or not isinstance(subgraphs, (list, type(None))):
        raise WorkflowError(f"the workflow's definitions must be an object with a list of "
                            f"subgraphs, not {shown(definitions)}")
    for graph in subgraphs or ():
        name = graph.get("id") if isinstance(graph, dict) else None
        if not isinstance(name, str):
            raise WorkflowError(f"a subgraph definition needs an id (a string): {shown(graph)}")
        check_editor_graph(graph, f"subgraph {name}")
    problem = nesting_problem(definitions)  # (what is not a subgraph's node)
    if problem:
        raise WorkflowError(f"the workflow's definitions {problem}")


def check_prompt(prompt) -> None:
    """An API prompt: node id -> ``{"class_type": name, "inputs": {...}}``."""
    if not isinstance(prompt, dict) or not prompt:
        raise WorkflowError("the prompt must be a JSON object of nodes: {\"1\": {\"class_type\": "
                            "..., \"inputs\": {...}}, ...}")
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or "class_type" not in node:
            raise WorkflowError(f"not a node: expected {{\"class_type\": ..., \"inputs\": "
                                f"{{...}}}}, not {shown(node)}", node_label(node_id), "?")
        if not isinstance(node["class_type"], str):
            raise WorkflowError(f"its class_type {shown(node['class_type'])} is "
                                f"{_kind(node['class_type'])}; a node type is a name (a string)",
                                node_label(node_id), "?")
        if not isinstance(node.get("inputs", {}), dict):
            raise WorkflowError(f"'inputs' must be an object, not {shown(node['inputs'])}",
                                node_label(node_id), node["class_type"])
        fields = [("input ", k, v) for k, v in node.get("inputs", {}).items()]
        for what, key, value in fields + [("", k, v) for k, v in node.items() if k != "inputs"]:
            problem = nesting_problem(value)
            if problem:
                raise WorkflowError(f"{what}{shown(key)} {problem}", node_label(node_id),
                                    node["class_type"])
