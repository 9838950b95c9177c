"""Run an API-format prompt (node id -> ``{"class_type", "inputs"}``; a link is ``[source node
id, output index]``) in this process with our nodes and the headless core nodes. As in ComfyUI,
the whole prompt is checked first (node types, links, each value against its input), then the
output nodes and what they need run in dependency order; each problem: a WorkflowError, named."""

from __future__ import annotations

import math
from typing import Optional

from ..errors import InputError, SeedVR2Error
from .core_nodes import CORE_NODES
from .errors import WorkflowError, WorkflowInterrupted
from .nodes import Input, NodeDef, NodeResult, build_nodes
from .shape import check_prompt, node_label, shown


def registry() -> dict[str, NodeDef]:
    return {node.id: node for node in (*build_nodes(), *CORE_NODES)}


def is_link(value) -> bool:
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int))
            and not isinstance(value[0], bool) and isinstance(value[1], int)
            and not isinstance(value[1], bool))


def coerce(inp: Input, value, host):
    """A widget value checked against its input, in the input's Python type. Text is read as
    ComfyUI reads it ("5" for an INT); numbers must be finite, text free of NUL."""
    kind = inp.type
    try:
        if kind == "INT":
            if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
                raise InputError
            value = int(value)
        elif kind == "FLOAT":
            if isinstance(value, bool):
                raise InputError
            value = float(value)
        elif kind == "BOOLEAN":
            if isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            elif not isinstance(value, bool):
                raise InputError
        elif kind in ("STRING", "COMBO") and not isinstance(value, str):
            if kind == "STRING" or inp.accepts_unlisted or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                raise InputError  # a COMBO of numbers takes a number
    except (TypeError, ValueError, OverflowError):
        expected = kind.lower() if kind != "COMBO" else "one of the choices"
        raise InputError(f"{inp.name} = {shown(value)}: expected {expected}") from None
    if kind == "FLOAT" and not math.isfinite(value):
        raise InputError(f"{inp.name} = {shown(value)}: expected a finite number")
    if isinstance(value, str) and "\x00" in value:
        raise InputError(f"{inp.name} = {shown(value)}: a NUL character is in the text")
    if inp.min is not None and value < inp.min:
        raise InputError(f"{inp.name} = {shown(value)}: below the minimum {inp.min}")
    if inp.max is not None and value > inp.max:
        raise InputError(f"{inp.name} = {shown(value)}: above the maximum {inp.max}")
    if kind == "COMBO" and not inp.accepts_unlisted:
        options = inp.options(host)
        if value not in options:
            listed = ", ".join(map(str, options[:12])) + (", ..." if len(options) > 12 else "")
            raise InputError(f"{inp.name} = {shown(value)}: not one of the choices "
                             f"({listed or 'none'})")
    return value


def validate(prompt: dict, nodes: dict[str, NodeDef], host) -> list[str]:
    """Check the prompt; returns the ids of the nodes to run, in dependency order."""
    check_prompt(prompt)
    prompt = _by_text_id(prompt)
    for node_id, node in prompt.items():
        if node["class_type"] not in nodes:
            ours = ", ".join(sorted(nodes))
            raise WorkflowError(f"unknown node type {shown(node['class_type'])}; this runner "
                                f"has {ours} (run other nodes on a ComfyUI server with --server)",
                                node_label(node_id), node["class_type"])
    outputs = [i for i, n in prompt.items() if nodes[n["class_type"]].output_node]
    if not outputs:
        raise WorkflowError("the workflow has no output node (such as SaveImage, SaveVideo, "
                            "PreviewImage or SeedVR2 Upscale Video File): nothing would run")
    order: list[str] = []
    done: set[str] = set()
    for output in outputs:
        _visit(output, prompt, nodes, host, done, order)
    return order


def _visit(start: str, prompt: dict, nodes: dict[str, NodeDef], host, done: set,
           order: list) -> None:
    """Check ``start`` and what it needs, depth first on a stack of its own (a chain of
    thousands of nodes is no recursion), each appended to ``order`` after its sources."""
    if start in done:
        return
    path, on_path = [start], {start}  # the nodes being visited, each waiting for its sources
    pending = [iter(_sources(start, prompt, nodes, host))]
    while pending:
        source_id = next(pending[-1], None)
        if source_id is None:
            pending.pop()
            node_id = path.pop()
            on_path.discard(node_id)
            done.add(node_id)
            order.append(node_id)
        elif source_id in on_path:
            cycle = " -> ".join(map(node_label, path[path.index(source_id):] + [source_id]))
            raise WorkflowError(f"the workflow has a cycle: {cycle}")
        elif source_id not in done:
            path.append(source_id)
            on_path.add(source_id)
            pending.append(iter(_sources(source_id, prompt, nodes, host)))


def _sources(node_id: str, prompt: dict, nodes: dict[str, NodeDef], host) -> list[str]:
    """The nodes ``node_id``'s inputs link to, each input checked."""
    node = prompt[node_id]
    found = []
    for inp in nodes[node["class_type"]].inputs:
        try:
            source_id = _check_input(inp, node.get("inputs", {}).get(inp.name), prompt, nodes,
                                     host)
        except ValueError as e:
            raise WorkflowError(str(e), node_label(node_id), node["class_type"]) from None
        if source_id is not None:
            found.append(source_id)
    return found


def _by_text_id(prompt: dict) -> dict:
    """Keyed by text ids (a Python caller may use numbers); "1" and 1 together are refused."""
    by_text = {}
    for node_id, node in prompt.items():
        if str(node_id) in by_text:
            raise WorkflowError(f"two nodes have the id {node_label(node_id)}",
                                node_label(node_id), node["class_type"])
        by_text[str(node_id)] = node
    return by_text


def _check_input(inp: Input, value, prompt: dict, nodes: dict[str, NodeDef],
                 host) -> Optional[str]:
    """One input's value checked (InputError); returns the node it links to."""
    if value is None:
        if not inp.optional:
            raise InputError(f"missing required input {inp.name!r}")
        return None
    if not is_link(value):
        if not inp.is_widget:
            raise InputError(f"input {inp.name!r} takes {inp.type} and must be linked to another "
                             f"node's output, not given the value {shown(value)}")
        coerce(inp, value, host)
        return None
    source_id, slot = str(value[0]), value[1]
    if source_id not in prompt:
        raise InputError(f"input {inp.name!r} is linked to node {node_label(source_id)}, which is "
                         f"not in the workflow")
    source = nodes[prompt[source_id]["class_type"]]
    if not 0 <= slot < len(source.outputs):
        raise InputError(f"input {inp.name!r} is linked to output {slot} of node {source_id} "
                         f"({source.id}), which has {len(source.outputs)} outputs")
    produced = source.outputs[slot].type
    if produced != inp.type and "*" not in (produced, inp.type):
        raise InputError(f"input {inp.name!r} takes {inp.type} but is linked to {source.id} "
                         f"output {slot} ({produced})")
    return source_id


def execute(prompt: dict, host, nodes: Optional[dict[str, NodeDef]] = None) -> dict[str, NodeResult]:
    """Validate, then run ``prompt``; returns every executed node's result by node id."""
    from ..pipeline.runner import Interrupted

    nodes = nodes or registry()
    order = validate(prompt, nodes, host)
    prompt = _by_text_id(prompt)
    results: dict[str, NodeResult] = {}
    for node_id in order:
        node = prompt[node_id]
        definition = nodes[node["class_type"]]
        kwargs = {}
        for inp in definition.inputs:
            value = node.get("inputs", {}).get(inp.name)
            if value is None:
                continue
            if is_link(value):
                value = results[str(value[0])].outputs[value[1]]
            elif inp.is_widget:
                value = coerce(inp, value, host)
            kwargs[inp.name] = value
        host.label = f"{node_id} {definition.display_name}"
        try:
            results[node_id] = definition.run(host, **kwargs)
        except (WorkflowInterrupted, Interrupted):
            raise WorkflowInterrupted("interrupted", node_id, node["class_type"]) from None
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a node's failure, reported with the node it happened in
            raise WorkflowError(_message(e), node_id, node["class_type"]) from e
        finally:
            if hasattr(host, "close_bar"):
                host.close_bar()
    return results


def _message(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text if isinstance(e, (SeedVR2Error, ValueError, OSError)) else \
        f"{type(e).__name__}: {text}"
