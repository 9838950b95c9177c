"""Run an API-format prompt (node id -> ``{"class_type", "inputs"}``; a link is ``[source node
id, output index]``) in this process: our nodes plus the headless core nodes. Like ComfyUI, the
whole prompt is checked first (node types, links, every value against its input's type, range and
choices), then the output nodes and what they need run in dependency order. Every problem is a
:class:`WorkflowError` naming the node.
"""

from __future__ import annotations

import reprlib
from typing import Optional

from .core_nodes import CORE_NODES
from .errors import WorkflowError, WorkflowInterrupted
from .nodes import Input, NodeDef, NodeResult, build_nodes


def registry() -> dict[str, NodeDef]:
    return {node.id: node for node in (*build_nodes(), *CORE_NODES)}


def is_link(value) -> bool:
    return (isinstance(value, list) and len(value) == 2 and isinstance(value[0], (str, int))
            and not isinstance(value[0], bool) and isinstance(value[1], int)
            and not isinstance(value[1], bool))


def coerce(inp: Input, value, host):
    """A widget value checked against its input; returns it in the input's Python type."""
    kind = inp.type
    try:
        if kind == "INT":
            if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
                raise ValueError
            value = int(value)
        elif kind == "FLOAT":
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
        elif kind == "BOOLEAN":
            if isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            elif not isinstance(value, bool):
                raise ValueError
        elif kind in ("STRING", "COMBO") and not isinstance(value, str):
            if kind == "STRING" or not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError  # a COMBO of numbers takes a number
    except (TypeError, ValueError):
        raise ValueError(f"{inp.name} = {value!r}: expected {kind.lower() if kind != 'COMBO' else 'one of the choices'}") from None
    if inp.min is not None and value < inp.min:
        raise ValueError(f"{inp.name} = {value!r}: below the minimum {inp.min}")
    if inp.max is not None and value > inp.max:
        raise ValueError(f"{inp.name} = {value!r}: above the maximum {inp.max}")
    if kind == "COMBO" and not inp.accepts_unlisted:
        options = inp.options(host)
        if value not in options:
            shown = ", ".join(map(str, options[:12])) + (", ..." if len(options) > 12 else "")
            raise ValueError(f"{inp.name} = {value!r}: not one of the choices ({shown or 'none'})")
    return value


def _check_shape(prompt) -> None:
    if not isinstance(prompt, dict) or not prompt:
        raise WorkflowError("the prompt must be a JSON object of nodes: {\"1\": {\"class_type\": "
                            "..., \"inputs\": {...}}, ...}")
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            raise WorkflowError("not a node: expected {\"class_type\": ..., \"inputs\": {...}}",
                                str(node_id), "?")
        if not isinstance(node.get("inputs", {}), dict):
            raise WorkflowError("'inputs' must be an object", str(node_id), node["class_type"])


def validate(prompt: dict, nodes: dict[str, NodeDef], host) -> list[str]:
    """Check the prompt; returns the ids of the nodes to run, in dependency order."""
    _check_shape(prompt)
    for node_id, node in prompt.items():
        if node["class_type"] not in nodes:
            ours = ", ".join(sorted(nodes))
            raise WorkflowError(f"unknown node type {node['class_type']!r}; this runner has "
                                f"{ours} (run other nodes on a ComfyUI server with --server)",
                                str(node_id), node["class_type"])
    outputs = [str(i) for i, n in prompt.items() if nodes[n["class_type"]].output_node]
    if not outputs:
        raise WorkflowError("the workflow has no output node (such as SaveImage, SaveVideo, "
                            "PreviewImage or SeedVR2 Upscale Video File): nothing would run")
    order: list[str] = []
    state: dict[str, str] = {}
    prompt = {str(k): v for k, v in prompt.items()}

    def visit(node_id: str, chain: tuple):
        if state.get(node_id) == "done":
            return
        if state.get(node_id) == "visiting":
            raise WorkflowError(f"the workflow has a cycle: {' -> '.join(chain + (node_id,))}")
        state[node_id] = "visiting"
        node = prompt[node_id]
        for inp in nodes[node["class_type"]].inputs:
            try:
                source_id = _check_input(inp, node.get("inputs", {}).get(inp.name), prompt, nodes,
                                         host)
            except ValueError as e:
                raise WorkflowError(str(e), node_id, node["class_type"]) from None
            if source_id is not None:
                visit(source_id, chain + (node_id,))
        state[node_id] = "done"
        order.append(node_id)

    for node_id in outputs:
        visit(node_id, ())
    return order


def _check_input(inp: Input, value, prompt: dict, nodes: dict[str, NodeDef],
                 host) -> Optional[str]:
    """Check one input's value (a ValueError says what is wrong); returns the node it links to."""
    if value is None:
        if not inp.optional:
            raise ValueError(f"missing required input {inp.name!r}")
        return None
    if not is_link(value):
        if not inp.is_widget:
            raise ValueError(f"input {inp.name!r} takes {inp.type} and must be linked to another "
                             f"node's output, not given the value {reprlib.repr(value)}")
        coerce(inp, value, host)
        return None
    source_id, slot = str(value[0]), value[1]
    if source_id not in prompt:
        raise ValueError(f"input {inp.name!r} is linked to node {source_id}, which is not in the "
                         f"workflow")
    source = nodes[prompt[source_id]["class_type"]]
    if not 0 <= slot < len(source.outputs):
        raise ValueError(f"input {inp.name!r} is linked to output {slot} of node {source_id} "
                         f"({source.id}), which has {len(source.outputs)} outputs")
    produced = source.outputs[slot].type
    if produced != inp.type and "*" not in (produced, inp.type):
        raise ValueError(f"input {inp.name!r} takes {inp.type} but is linked to {source.id} "
                         f"output {slot} ({produced})")
    return source_id


def execute(prompt: dict, host, nodes: Optional[dict[str, NodeDef]] = None) -> dict[str, NodeResult]:
    """Validate, then run ``prompt``; returns every executed node's result by node id."""
    from ..pipeline.runner import Interrupted

    nodes = nodes or registry()
    prompt = {str(k): v for k, v in prompt.items()} if isinstance(prompt, dict) else prompt
    order = validate(prompt, nodes, host)
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
    return text if isinstance(e, (ValueError, FileExistsError, OSError)) else \
        f"{type(e).__name__}: {text}"
