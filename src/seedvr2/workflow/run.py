"""``run_workflow``: a UI- or API-format workflow, run in this process or on a ComfyUI server."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from .convert import is_ui_format, ui_to_api
from .errors import WorkflowError
from .execute import execute, registry
from .host import HeadlessHost
from .nodes import object_info as node_object_info
from .numz import translate_prompt
from .shape import check_prompt, node_label, shown
from .server import ComfyServer, ProgressPrinter, upload_inputs


@dataclass
class RunResult:
    prompt: dict  # the API-format prompt that ran
    files: list = field(default_factory=list)  # saved outputs (downloaded, with --server)
    warnings: list = field(default_factory=list)
    uploads: list = field(default_factory=list)  # (local file, name on the server), --server


def load_workflow(path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise WorkflowError(f"{path}: cannot read the workflow: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise WorkflowError(f"{path}: not a workflow: not UTF-8 text (byte {e.start}); a "
                            f"workflow is JSON as the editor saves it") from None
    try:
        workflow = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkflowError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column "
                            f"{e.colno}") from None
    except RecursionError:
        raise WorkflowError(f"{path}: not a workflow: JSON nested too deeply") from None
    except ValueError as e:  # a number of more digits than Python reads (int_max_str_digits)
        raise WorkflowError(f"{path}: not a workflow: {e}".split("; use sys.")[0]) from None
    if not isinstance(workflow, dict):
        raise WorkflowError(f"{path}: a workflow is a JSON object, not {type(workflow).__name__}")
    return workflow


def builtin_object_info(host) -> dict:
    """``/object_info`` of the nodes this runner has (ours and the headless core nodes)."""
    return {node_id: node_object_info(node, host) for node_id, node in registry().items()}


def to_api(workflow: dict, object_info: dict,
           warn: Optional[Callable[[str], None]] = None) -> dict:
    """The API-format prompt of a workflow in either format; our nodes saved by the numz pack
    take our layout (``warn``: a note per value left out). Malformed: WorkflowError (.shape)."""
    if is_ui_format(workflow):
        return ui_to_api(workflow, object_info, warn)
    if isinstance(workflow, dict) and isinstance(workflow.get("prompt"), dict):
        workflow = workflow["prompt"]  # a saved /prompt request body
    if not isinstance(workflow, dict) or not any(
            isinstance(n, dict) and "class_type" in n for n in workflow.values()):
        raise WorkflowError("not a workflow: expected the editor's format (with \"nodes\" and "
                            "\"links\") or the API format ({\"1\": {\"class_type\": ..., "
                            "\"inputs\": {...}}})")
    check_prompt(workflow)  # names the entry that is no node
    prompt, notes = translate_prompt(workflow, object_info)
    for note in notes if warn is not None else ():
        warn(note)
    return prompt


def _parse_value(item: str, text: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise WorkflowError(f"--set {_said(item)}: the value nests too deeply") from None
    except ValueError:
        return text  # a bare string: --set 1.image=photo.png


def _said(text: str) -> str:
    """Command-line text for a one-line message: as typed, or quoted if unprintable or long."""
    return text if text.isprintable() and len(text) <= 200 else shown(text)


def _find_node(prompt: dict, key: str) -> str:
    if key in prompt:
        return key
    by_title = [i for i, n in prompt.items()
                if isinstance(n.get("_meta"), dict) and n["_meta"].get("title") == key]
    by_type = [i for i, n in prompt.items() if n.get("class_type") == key]
    for matches in (by_title, by_type):
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise WorkflowError(f"--set {_said(key)}: {len(matches)} nodes match "
                                f"({', '.join(map(node_label, matches))}); "
                                f"use the node id")
    listing = ", ".join(f"{node_label(i)} {n['class_type']}" for i, n in prompt.items())
    raise WorkflowError(f"--set {_said(key)}: no node with this id, title or type (nodes: "
                        f"{listing})")


def apply_sets(prompt: dict, sets: Iterable[str], object_info: dict) -> dict:
    """``NODE.INPUT=VALUE`` overrides; NODE: node id, title or unique type; VALUE: JSON or text."""
    prompt = json.loads(json.dumps(prompt))
    for item in sets:
        target, sep, raw = item.partition("=")
        node_key, dot, name = target.rpartition(".")
        if not sep or not dot or not node_key or not name:
            raise WorkflowError(f"--set {_said(item)}: expected NODE.INPUT=VALUE, e.g. "
                                f"3.resolution=1080")
        node_id = _find_node(prompt, node_key)
        node = prompt[node_id]
        info = object_info.get(node["class_type"], {}).get("input", {})
        known = [n for section in ("required", "optional") for n in (info.get(section) or {})]
        if known and name not in known:
            raise WorkflowError(f"--set {_said(item)}: node {node_label(node_id)} "
                                f"({node['class_type']}) has no input {shown(name)} (inputs: "
                                f"{', '.join(known)})")
        node.setdefault("inputs", {})[name] = _parse_value(item, raw)
    return prompt


def run_workflow(workflow: Union[str, Path, dict], sets: Iterable[str] = (), *,
                 host: Optional[HeadlessHost] = None, server: Optional[str] = None,
                 timeout: Optional[float] = None) -> RunResult:
    """Run ``workflow`` (a path or a parsed workflow) with ``--set``-style overrides on ``host``
    (default: a HeadlessHost of the default folders), or on the ComfyUI at ``server`` (inputs it
    lacks uploaded from the host's folders, outputs downloaded). WorkflowError names the node."""
    if isinstance(workflow, (str, Path)):
        workflow = load_workflow(workflow)
    elif not isinstance(workflow, dict):
        raise WorkflowError(f"not a workflow: {shown(workflow)} (give a file's path, or the "
                            f"workflow as a dict)")
    host = host or HeadlessHost()
    if server is not None:
        return _run_on_server(workflow, sets, ComfyServer(server), host, timeout)
    info = builtin_object_info(host)
    prompt = apply_sets(to_api(workflow, info, host.warn), sets, info)
    execute(prompt, host)
    return RunResult(prompt, list(host.saved), list(host.warnings))


def _run_on_server(workflow: dict, sets: Iterable[str], client: ComfyServer,
                   host: HeadlessHost, timeout: Optional[float]) -> RunResult:
    uploads = []  # (local file, name on the server)

    def say(text):
        if not host.quiet:
            print(text, file=sys.stderr, flush=True)

    def uploaded(local, name):
        uploads.append((local, name))
        say(f"uploaded {local} to the server's input folder as {name!r}")

    info = client.object_info()
    prompt = apply_sets(to_api(workflow, info, lambda note: say(f"note: {note}")), sets, info)
    prompt = upload_inputs(client, prompt, info, host.input_dir, on_upload=uploaded)
    printer = None if host.quiet else ProgressPrinter(prompt)
    try:
        entry = client.run(prompt, timeout=timeout, on_event=printer)
    finally:
        if printer is not None:
            printer.close()
    return RunResult(prompt, client.download(entry, host.output_dir), uploads=uploads)
