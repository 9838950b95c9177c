"""Property-based hostile tests of ComfyUI workflows and API prompts (ours and numz's, every
layout), through every entry point that reads them: ``seedvr2 run-workflow``, the in-process
runner and its validation (:mod:`seedvr2.workflow.execute`, :mod:`~seedvr2.workflow.run`), the
UI -> API conversion (:mod:`~seedvr2.workflow.convert`), the numz rewriting
(:mod:`~seedvr2.workflow.numz`) and the pack's hooks inside ComfyUI (``nodes.py``: the
``/prompt`` handler and the editor's numz route).

The invariant (tests/hostile.py): a correct result, or one :class:`WorkflowError` naming the
node (the CLI: one ``error:`` line, status 1); never another exception, a traceback or a
``RecursionError``. Three kinds of strategy: structure generated from nothing (dicts, lists and
scalars at any depth, with the keys workflows use), the example workflows mutated field by
field, and numz's layouts of every release with generated values.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO
from hostile import outcome, run_cli
from test_numz import (OLD_SEEDVR2, OLD_VALUES, numz_api_prompt, numz_ui_workflow, old_api_prompt,
                       old_ui_workflow)
from test_workflows import inputs  # noqa: F401 (fixture)

from seedvr2.workflow.errors import WorkflowError
from seedvr2.workflow.execute import registry, validate
from seedvr2.workflow.host import HeadlessHost
from seedvr2.workflow.numz import translate_prompt, translate_workflow
from seedvr2.workflow.run import builtin_object_info, to_api
from seedvr2.workflow.shape import shown

EXAMPLES_DIR = REPO / "example_workflows"
UI_EXAMPLES = {p.stem: json.loads(p.read_text()) for p in sorted(EXAMPLES_DIR.glob("*.json"))}
API_EXAMPLES = {p.stem: json.loads(p.read_text())
                for p in sorted((EXAMPLES_DIR / "api").glob("*.json"))}

# ---------------------------------------------------------------------------------------------
# Strategies

NODE_TYPES = sorted(n.id for n in registry().values()) + [
    "SeedVR2", "SeedVR2BlockSwap", "SeedVR2ExtraArgs", "Reroute", "PrimitiveNode", "Note",
    "MarkdownNote", "FancyNode"]
# The keys workflows and prompts are read by: random dicts use them, so they reach the readers.
KEYS = ["nodes", "links", "id", "type", "class_type", "inputs", "outputs", "widgets_values",
        "link", "widget", "name", "mode", "definitions", "subgraphs", "prompt", "_meta",
        "title", "pos", "properties", "origin_id", "origin_slot", "target_id", "target_slot",
        "last_node_id", "last_link_id", "images", "image", "dit", "vae", "video", "seed",
        "batch_size", "temporal_overlap", "blocks_to_swap", "filename_prefix", "model",
        "block_swap_config", "extra_args", "new_resolution", "resolution", "preserve_vram"]
HOSTILE_TEXT = ["", " ", "..", "../x.png", "/etc/passwd", "a\x00b", "\x00", "²", "~", "1_0",
                "nan", "inf", "-1", "1e999", "[output]", "x [output]", "../ [temp]", "%width%",
                "SeedVR2/", ".", "a/..", "\u202e", "fixed", "randomize", "auto", "none", "cpu",
                "x" * 300]
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**400, -10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(HOSTILE_TEXT + NODE_TYPES + KEYS),
    st.text(max_size=8))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) |
    st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=4),
    max_leaves=12)


def nested(value, depth: int, kind: str):
    """``value`` inside ``depth`` lists or dicts."""
    for _ in range(depth):
        value = [value] if kind == "list" else {"inputs": value}
    return value


# Values nested past any sane workflow, and past Python's recursion limit.
deep_values = st.builds(nested, json_values, st.sampled_from([50, 200, 600, 1200]),
                        st.sampled_from(["list", "dict"]))
hostile_values = st.one_of(json_values, deep_values)
node_ids = st.one_of(st.integers(-3, 12), st.sampled_from(["1", "2", "²", "", "-1", "1.0"]),
                     st.lists(st.integers(0, 5), max_size=2), st.none(), st.floats())


@st.composite
def ui_workflows(draw):
    """An editor workflow's shape, with any value where the editor writes a known one."""
    def pick(known, hostile=hostile_values):
        return draw(st.one_of(known, hostile)) if draw(st.booleans()) else draw(known)

    nodes = []
    for _ in range(draw(st.integers(0, 5))):
        inputs = [{"name": pick(st.sampled_from(KEYS)), "type": pick(st.sampled_from(["IMAGE"])),
                   "link": pick(st.integers(0, 8) | st.none()),
                   **({"widget": pick(st.fixed_dictionaries({"name": st.sampled_from(KEYS)}))}
                      if draw(st.booleans()) else {})}
                  for _ in range(draw(st.integers(0, 3)))]
        node = {"id": pick(node_ids), "type": pick(st.sampled_from(NODE_TYPES)),
                "mode": pick(st.sampled_from([0, 2, 4])),
                "inputs": pick(st.just(inputs)),
                "outputs": pick(st.just([{"name": "x", "type": "IMAGE",
                                          "links": draw(st.lists(st.integers(0, 8),
                                                                 max_size=2))}])),
                "widgets_values": pick(st.lists(scalars, max_size=12))}
        nodes.append({k: v for k, v in node.items() if draw(st.integers(0, 9))})  # some missing
    links = draw(st.lists(st.one_of(
        st.tuples(st.integers(0, 8), node_ids, st.integers(-1, 3), node_ids, st.integers(-1, 3),
                  st.sampled_from(["IMAGE", "SEEDVR2_DIT", "*"])).map(list),
        hostile_values), max_size=6))
    workflow = {"nodes": nodes, "links": links, "last_node_id": pick(st.integers(0, 9)),
                "last_link_id": pick(st.integers(0, 9)), "version": 0.4}
    if draw(st.integers(0, 4)) == 0:
        workflow["definitions"] = draw(st.one_of(
            hostile_values, st.fixed_dictionaries({"subgraphs": st.lists(st.fixed_dictionaries(
                {"id": st.sampled_from(NODE_TYPES), "nodes": st.just(nodes)}), max_size=1)})))
    return workflow


@st.composite
def api_prompts(draw):
    """An API prompt's shape: node id -> {class_type, inputs}, links as [id, slot]."""
    prompt = {}
    for _ in range(draw(st.integers(1, 5))):
        node_id = draw(st.sampled_from(["1", "2", "3", "4", "5", "²", "", " 1"]))
        inputs = draw(st.dictionaries(
            st.sampled_from(KEYS) | st.text(max_size=4),
            st.one_of(st.tuples(st.sampled_from(["1", "2", "3", "9", "²"]) | st.integers(0, 4),
                                st.integers(-1, 3)).map(list), hostile_values), max_size=6))
        node = {"class_type": draw(st.sampled_from(NODE_TYPES) | hostile_values),
                "inputs": draw(st.just(inputs) | hostile_values)}
        prompt[node_id] = node if draw(st.integers(0, 9)) else draw(hostile_values)
    return {"prompt": prompt} if draw(st.integers(0, 5)) == 0 else prompt


def _paths(value, prefix=()):
    """Every path into a JSON value (keys and indexes), the value itself first."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


def _mutate(value, path, change):
    if not path:
        return change(value)
    value = copy.copy(value)
    value[path[0]] = _mutate(value[path[0]], path[1:], change)
    return value


@st.composite
def mutated(draw, workflows: dict):
    """A known-good workflow with one field (any depth) replaced, removed, or given a
    neighbour's type: the field-by-field attack."""
    name = draw(st.sampled_from(sorted(workflows)))
    workflow = workflows[name]
    path = draw(st.sampled_from(list(_paths(workflow))[1:]))
    how = draw(st.sampled_from(["replace", "delete", "wrap"]))
    if how == "delete" and isinstance(path[-1], str):
        parent = _mutate(workflow, path[:-1], lambda d: {k: v for k, v in d.items()
                                                         if k != path[-1]})
        return parent
    if how == "wrap":
        return _mutate(workflow, path, lambda v: draw(st.sampled_from([[v], {"x": v}, str(v),
                                                                        [v, v, v]])))
    return _mutate(workflow, path, lambda v: draw(hostile_values))


def chain(length: int, kind: str) -> dict:
    """LoadImage -> ``length`` nodes in a row -> SaveImage: upscalers linked image to image (an
    API prompt), or the editor's Reroute or bypassed nodes (a UI workflow)."""
    if kind == "api":
        prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": "example.png"}}}
        for i in range(2, length + 2):
            prompt[str(i)] = {"class_type": "SeedVR2VideoUpscaler",
                              "inputs": {"image": [str(i - 1), 0]}}
        prompt["0"] = {"class_type": "SaveImage", "inputs": {"images": [str(length + 1), 0],
                                                             "filename_prefix": "chain"}}
        return prompt
    nodes = [{"id": 1, "type": "LoadImage", "mode": 0, "inputs": [],
              "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]}],
              "widgets_values": ["example.png", "image"]}]
    for i in range(2, length + 2):
        nodes.append({"id": i, "type": "Reroute" if kind == "reroute" else "SeedVR2VideoUpscaler",
                      "mode": 0 if kind == "reroute" else 4,
                      "inputs": [{"name": "image", "type": "IMAGE", "link": i - 1}],
                      "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [i]}]})
    nodes.append({"id": length + 2, "type": "SaveImage", "mode": 0,
                  "inputs": [{"name": "images", "type": "IMAGE", "link": length + 1}],
                  "outputs": [], "widgets_values": ["chain"]})
    links = [[i, i, 0, i + 1, 0, "IMAGE"] for i in range(1, length + 2)]
    return {"nodes": nodes, "links": links, "version": 0.4}


chains = st.builds(chain, st.sampled_from([1, 50, 5000]), st.sampled_from(["api", "reroute",
                                                                          "bypass"]))


def _numz_workflows() -> dict:
    """numz's layouts of every release, both formats."""
    found = {"numz v2.5 editor": numz_ui_workflow(compile_args=True),
             "numz v2.5 editor positional": numz_ui_workflow(names=False),
             "numz v2.5 api": numz_api_prompt()}
    for date in OLD_SEEDVR2:
        found[f"numz {date} editor"] = old_ui_workflow(date)
        found[f"numz {date} api"] = old_api_prompt(date)
    return found


NUMZ_WORKFLOWS = _numz_workflows()
ALL_WORKFLOWS = {**{f"ui {k}": v for k, v in UI_EXAMPLES.items()},
                 **{f"api {k}": v for k, v in API_EXAMPLES.items()}, **NUMZ_WORKFLOWS}
# numz v2.0-2.4's layouts with any value in any field
old_numz = st.builds(
    lambda date, values, editor: (old_ui_workflow if editor else old_api_prompt)(date, values),
    st.sampled_from(sorted(OLD_SEEDVR2)),
    st.fixed_dictionaries({name: st.one_of(st.just(value), hostile_values)
                           for name, value in OLD_VALUES.items()}),
    st.booleans())
any_workflow = st.one_of(ui_workflows(), api_prompts(), mutated(ALL_WORKFLOWS), old_numz, chains,
                         hostile_values)

# ---------------------------------------------------------------------------------------------
# The entry points


@pytest.fixture(scope="module")
def host(tiny_model_dir, tmp_path_factory):
    inputs = tmp_path_factory.mktemp("hostile_inputs")
    (inputs / "example.png").write_bytes(b"")  # listed, never read: nothing here executes
    return HeadlessHost(model_dir=tiny_model_dir, input_dir=inputs,
                        output_dir=tmp_path_factory.mktemp("hostile_out"), quiet=True)


@pytest.fixture(scope="module")
def info(host):
    return builtin_object_info(host)


def convert_and_validate(workflow, info, host):
    """What ``run_workflow`` does before the first node runs."""
    notes = []
    prompt = to_api(workflow, info, notes.append)
    return validate(prompt, registry(), host)


@given(workflow=any_workflow)
def test_conversion_and_validation_end_in_a_prompt_or_one_workflow_error(workflow, info, host):
    outcome(lambda: convert_and_validate(workflow, info, host))


@given(workflow=any_workflow)
def test_the_numz_rewriting_returns_a_workflow_or_one_workflow_error(workflow, info):
    """What the pack's routes inside ComfyUI call (the editor's numz route, POST /prompt)."""
    outcome(lambda: translate_workflow(workflow, info))
    outcome(lambda: translate_prompt(workflow, info))


# ---------------------------------------------------------------------------------------------
# seedvr2 run-workflow: any file, any --set

# File contents: JSON of any shape, and text that is hardly JSON (numbers past what Python
# reads, nesting past its recursion limit, bytes that are not UTF-8).
raw_texts = st.one_of(
    st.sampled_from(["", "{", "[]", "null", "NaN", "1" * 5000, "[" * 100_000,
                     '{"1": {"class_type": "LoadImage", "inputs": {"image": ' + "9" * 5000 + "}}}",
                     "\ufeff{}"]).map(str.encode),
    st.binary(max_size=40))


def dumps(value) -> bytes:
    """JSON text of any value, at any depth (json.dumps recurses; this does not)."""
    parts, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Text):
            parts.append(item)
        elif isinstance(item, dict):
            stack.append(_Text("}"))
            for i, (key, inner) in enumerate(reversed(list(item.items()))):
                stack += [inner, _Text(json.dumps(str(key)) + ":")]
                if i < len(item) - 1:
                    stack.append(_Text(","))
            stack.append(_Text("{"))
        elif isinstance(item, list):
            stack.append(_Text("]"))
            for i, inner in enumerate(reversed(item)):
                stack.append(inner)
                if i < len(item) - 1:
                    stack.append(_Text(","))
            stack.append(_Text("["))
        else:
            parts.append(json.dumps(item))
    return "".join(parts).encode()


class _Text(str):
    """Text :func:`dumps` writes as it is."""


@given(content=st.one_of(any_workflow.map(dumps), raw_texts))
@settings(max_examples=max(10, settings.default.max_examples // 2))
def test_run_workflow_reads_any_file_to_a_run_or_one_error_line(content, tiny_model_dir,
                                                                 tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    path = folder / "workflow.json"
    path.write_bytes(content)
    run = run_cli(["run-workflow", str(path), "--model-dir", str(tiny_model_dir), "--input-dir",
                   str(folder), "--output-dir", str(folder / "out"), "-q"])
    if run.status:
        assert run.status == 1 and run.stderr.startswith("error: "), run.stderr
        assert run.stderr.count("\n") == 1, run.stderr


set_values = st.one_of(
    st.sampled_from(["", "1e999", "NaN", "-Infinity", "[" * 5000, "1" * 5000, '"a\\u0000b"',
                     "../../x", "/etc/passwd", "[1, 2]", "{}", "null", "true", "²", "1_0"]),
    json_values.map(json.dumps), st.text(max_size=10))


@given(target=st.sampled_from(["4.resolution", "4.seed", "4.scene_cuts", "4.devices",
                               "5.filename_prefix", "1.image", "2.model", "SaveImage.images",
                               "4.", ".seed", "4", "", "9.seed", "4.sead", "²."]),
       value=set_values)
@settings(max_examples=max(10, settings.default.max_examples // 2))
def test_run_workflow_sets_any_value_to_a_run_or_one_error_line(target, value, tiny_model_dir,
                                                                tmp_path_factory):
    """The overrides of the command line, on the image example: refused at validation, one
    line naming the node (the models are not found, so nothing runs)."""
    folder = tmp_path_factory.mktemp("cli_set")
    run = run_cli(["run-workflow", str(EXAMPLES_DIR / "api" / "image_upscale.json"),
                   "--model-dir", str(folder), "--input-dir", str(folder), "--output-dir",
                   str(folder / "out"), "-q", "--set", f"{target}={value}"])
    assert run.status == 1 and run.stderr.startswith("error: "), run.stderr
    assert run.stderr.count("\n") == 1, run.stderr


# ---------------------------------------------------------------------------------------------
# Inside ComfyUI: the /prompt handler and the editor's numz route (nodes.py)


@pytest.fixture(scope="module")
def pack(info):
    """The pack's nodes.py (:func:`conftest.import_pack`); its numz table is our nodes'
    /object_info."""
    from conftest import import_pack

    nodes = import_pack("seedvr2_pack_hostile")
    numz_info = {kind: info[kind] for kind in nodes.NUMZ_NODES}
    nodes._numz_object_info = lambda: numz_info
    return nodes


@given(workflow=any_workflow)
def test_the_packs_hooks_in_comfyui_answer_any_workflow(workflow, pack):
    """The /prompt handler never raises (ComfyUI would log a traceback and go on); the route
    answers a workflow and notes, or 400 and the reason, as JSON."""
    json_data = {"prompt": workflow, "client_id": "hostile"}
    assert pack._numz_prompt(json_data) is json_data
    reply, status = pack.numz_workflow_reply(workflow)
    if status == 400:
        assert reply["error"].strip() and "\n" not in reply["error"], reply
    else:
        assert status == 200 and set(reply) == {"workflow", "notes"}
    json.dumps(reply)  # what web.json_response sends


# ---------------------------------------------------------------------------------------------
# Our nodes' inputs given any value through a prompt, run with the tiny models


def tiny_image_prompt() -> dict:
    """The image example at 16 px with the tiny models on the CPU (about a second)."""
    prompt = copy.deepcopy(API_EXAMPLES["image_upscale"])
    prompt["2"]["inputs"].update(model="dit3b_tiny.safetensors", device="cpu")
    prompt["3"]["inputs"].update(model="vae_tiny.safetensors", device="cpu")
    prompt["4"]["inputs"].update(resolution=16, batch_size=1, offload_device="none")
    return prompt


def tiny_file_prompt() -> dict:
    """The loaders -> Upscale Video File of the example image (a file job, 16 px)."""
    prompt = tiny_image_prompt()
    upscaler = {k: v for k, v in prompt.pop("4")["inputs"].items() if k != "image"}
    del prompt["1"], prompt["5"]
    prompt["6"] = {"class_type": "SeedVR2UpscaleVideoFile", "inputs": {
        **upscaler, "video_path": "example.png", "filename_prefix": "SeedVR2/file",
        "codec": "h264"}}
    return prompt


TINY_PROMPTS = {"image": tiny_image_prompt, "file": tiny_file_prompt}
OUR_WIDGETS = [(kind, node_id, name) for kind, make in TINY_PROMPTS.items()
               for node_id, node in make().items() if kind == "image" or node_id == "6"
               for name, value in node["inputs"].items() if not isinstance(value, list)]
input_values = st.one_of(
    st.sampled_from(HOSTILE_TEXT + ["example.png", "example.png [input]", "/example.png",
                                    "SeedVR2/../../x", "missing.mp4", "0", "17", "1e3", " 5 "]),
    st.sampled_from([math.nan, math.inf, -math.inf, 10**400, 2**63, -2**63, -1, 0, 1, 5, 1.5,
                     1e308, -0.0, True, False, None, [], ["a"], {"a": 1}, [["1", 0]], ["1", 0]]),
    scalars, json_values)


@given(target=st.sampled_from(OUR_WIDGETS), value=input_values)
@settings(max_examples=max(8, settings.default.max_examples // 2))
def test_any_value_in_any_input_is_a_run_or_one_error_naming_node_and_input(
        target, value, tiny_model_dir, inputs, tmp_path_factory):
    from seedvr2.memory import MODEL_CACHE
    from seedvr2.workflow.run import run_workflow

    kind, node_id, name = target
    prompt = TINY_PROMPTS[kind]()
    prompt[node_id]["inputs"][name] = value
    out = tmp_path_factory.mktemp("out")
    host = HeadlessHost(model_dir=tiny_model_dir, input_dir=inputs, output_dir=out, quiet=True)
    try:
        result = outcome(lambda: run_workflow(prompt, host=host), f"node {node_id} ")
    finally:
        MODEL_CACHE.clear()
    if result.refused:
        assert name in result.message, result.message
        cause = result.error.__cause__  # a node's failure: one raised on purpose
        assert cause is None or isinstance(cause, ValueError), repr(cause)
    else:
        (saved,) = result.value.files
        assert saved.is_file() and out in saved.parents and not saved.name.startswith(".")


# ---------------------------------------------------------------------------------------------
# The kinds issue #33's round of hostile use found (each ended in a traceback before)


def _refusal(call) -> str:
    with pytest.raises(WorkflowError) as caught:
        call()
    return str(caught.value)


@pytest.mark.parametrize("kind", ["api", "reroute", "bypass"])
def test_a_chain_of_5000_nodes_is_walked_without_recursion(kind, info, host):
    workflow = chain(5000, kind)
    if kind == "api":  # the chain is checked; its first upscaler lacks its models
        assert _refusal(lambda: convert_and_validate(workflow, info, host)) == \
            "node 5001 (SeedVR2VideoUpscaler): missing required input 'dit'"
    else:  # Reroutes and bypassed nodes pass the image on: LoadImage -> SaveImage
        assert convert_and_validate(workflow, info, host) == ["1", "5002"]


def test_a_value_nested_600_deep_is_one_error_naming_node_and_input(info, host, tmp_path):
    prompt = copy.deepcopy(API_EXAMPLES["image_upscale"])
    prompt["4"]["inputs"]["seed"] = nested(7, 600, "list")
    assert _refusal(lambda: convert_and_validate(prompt, info, host)) == (
        "node 4 (SeedVR2VideoUpscaler): input 'seed' nests values more than 100 levels deep: "
        "not something a workflow holds")
    ui = copy.deepcopy(UI_EXAMPLES["image_upscale"])
    ui["nodes"][3]["widgets_values"][2] = nested(7, 600, "dict")
    assert _refusal(lambda: convert_and_validate(ui, info, host)) == (
        "node 4 (SeedVR2VideoUpscaler): 'widgets_values' nests values more than 100 levels "
        "deep: not something a workflow holds")
    path = tmp_path / "deep.json"
    path.write_bytes(dumps(prompt))
    run = run_cli(["run-workflow", str(path), "--model-dir", str(tmp_path), "-q"])
    assert (run.status, run.stderr) == (1, "error: node 4 (SeedVR2VideoUpscaler): input 'seed' "
                                           "nests values more than 100 levels deep: not "
                                           "something a workflow holds\n")


def _ui_with(change) -> dict:
    ui = copy.deepcopy(UI_EXAMPLES["image_upscale"])
    change({n["id"]: n for n in ui["nodes"]}, ui)
    return ui


def _api_with(change) -> dict:
    prompt = copy.deepcopy(API_EXAMPLES["image_upscale"])
    change(prompt)
    return prompt


@pytest.mark.parametrize("workflow, message", [
    (_ui_with(lambda n, ui: n[4].update(type=["SeedVR2VideoUpscaler"])),
     "node 4 (?): its type ['SeedVR2VideoUpscaler'] is a list; a node type is a name (a string)"),
    (_api_with(lambda p: p["4"].update(class_type=["SeedVR2VideoUpscaler"])),
     "node 4 (?): its class_type ['SeedVR2VideoUpscaler'] is a list; a node type is a name (a "
     "string)"),
    (_ui_with(lambda n, ui: n[4].update(id=[4])),
     "node #4 of the nodes list (SeedVR2VideoUpscaler): its id [4] is a list; a node id is a "
     "number or a string"),
    (_ui_with(lambda n, ui: n[4].update(inputs="image")),
     "node 4 (SeedVR2VideoUpscaler): 'inputs' must be a list of slots, not a string ('image')"),
    (_ui_with(lambda n, ui: n[4].update(inputs=[["image", "IMAGE", 1]])),
     "node 4 (SeedVR2VideoUpscaler): inputs[0] must be an object, not a list (['image', "
     "'IMAGE', 1])"),
    (_api_with(lambda p: p["4"].update(inputs=["image"])),
     "node 4 (SeedVR2VideoUpscaler): 'inputs' must be an object, not ['image']"),
    (_api_with(lambda p: p["5"].update(inputs="SeedVR2/image")),
     "node 5 (SaveImage): 'inputs' must be an object, not 'SeedVR2/image'"),
    # A link to an output slot the node does not have: direct, and through a bypassed node.
    (_ui_with(lambda n, ui: ui["links"][0].__setitem__(2, 5)),
     "node 4 (SeedVR2VideoUpscaler): input 'image' is linked to output 5 of node 1 (LoadImage), "
     "which has 2 outputs"),
    (_ui_with(lambda n, ui: (n[4].update(mode=4), ui["links"][3].__setitem__(2, 7),
                             ui["links"][3].__setitem__(5, None))),
     "node 5 (SaveImage): missing required input 'images'"),
    (_ui_with(lambda n, ui: ui["links"].append([9, 1, -1, 4, 0, "IMAGE"])),
     "node 4 (SeedVR2VideoUpscaler): malformed link [9, 1, -1, 4, ...]: expected [id, origin "
     "node, output slot, target node, input slot, type]"),
])
def test_a_malformed_workflow_is_one_error_naming_the_node(workflow, message, info, host):
    assert _refusal(lambda: convert_and_validate(workflow, info, host)) == message


def test_node_ids_that_are_no_numbers_are_ids_all_the_same(info, host):
    """'²' is a digit to str.isdigit, not to int: numz's old node under that id is rewritten,
    its new loaders numbered after the prompt's numeric ids."""
    prompt = old_api_prompt("2025-09-22")
    prompt["²"] = prompt.pop("4")
    prompt["6"]["inputs"]["images"] = ["²", 0]
    translated = to_api(prompt, info)
    assert translated["²"]["class_type"] == "SeedVR2VideoUpscaler"
    assert (translated["²"]["inputs"]["dit"], translated["²"]["inputs"]["vae"]) == \
        (["7", 0], ["8", 0])
    assert validate(translated, registry(), host) == ["1", "7", "8", "²", "6"]


@pytest.mark.parametrize("workflow, message", [
    ({**old_api_prompt("2025-09-22"), "2": {"class_type": "SeedVR2BlockSwap", "inputs": {
        "blocks_to_swap": [2], "use_non_blocking": False, "offload_io_components": False}}},
     "node 4 (SeedVR2): numz's blocks_to_swap = [2]: a widget value is a number, a text or a "
     "switch, not a list"),
    (numz_api_prompt() | {"4": {"class_type": "SeedVR2VideoUpscaler", "inputs": {
        **numz_api_prompt()["4"]["inputs"], "seed": {"value": 7}}}},
     "node 4 (SeedVR2VideoUpscaler): numz's seed = {'value': 7}: a widget value is a number, a "
     "text or a switch, not an object"),
])
def test_a_numz_widget_value_that_is_a_list_is_one_error_naming_the_node(workflow, message, info,
                                                                          host):
    assert _refusal(lambda: convert_and_validate(workflow, info, host)) == message
    ui = numz_ui_workflow()
    ui["nodes"][3]["widgets_values"][0] = [7]  # the upscaler's seed
    assert _refusal(lambda: convert_and_validate(ui, info, host)) == (
        "node 4 (SeedVR2VideoUpscaler): numz's seed = [7]: a widget value is a number, a text or "
        "a switch, not a list")


@pytest.mark.parametrize("prefix, default", [("", True), ("  ", True), (".", True),
                                             ("./", True), ("sub/..", True), ("sub/", False),
                                             ("SeedVR2/x", False), (".x", False)])
def test_a_prefix_that_names_no_file_takes_the_nodes_default(prefix, default):
    from seedvr2.workflow.nodes import output_prefix

    assert output_prefix(prefix, "SeedVR2/video") == ("SeedVR2/video" if default else prefix)


def test_a_prefix_no_file_system_holds_is_refused_naming_it():
    from seedvr2.workflow.nodes import output_prefix

    assert output_prefix("d" * 200 + "/" + "f" * 200, "x") == "d" * 200 + "/" + "f" * 200
    with pytest.raises(ValueError) as caught:
        output_prefix("SeedVR2/" + "é" * 101, "x")
    assert str(caught.value) == (f"filename_prefix = {shown('SeedVR2/' + 'é' * 101)}: a file or "
                                 f"folder name in it is longer than 200 bytes")


def test_an_empty_filename_prefix_saves_under_the_nodes_default_name(tiny_model_dir, inputs,
                                                                     tmp_path):
    """Not a hidden ._00001_.png: Save Image's and Upscale Video File's own default names."""
    from seedvr2.memory import MODEL_CACHE
    from seedvr2.workflow.run import run_workflow

    prompt = tiny_image_prompt()
    prompt["5"]["inputs"]["filename_prefix"] = ""
    prompt["6"] = {"class_type": "SeedVR2UpscaleVideoFile", "inputs": {
        **{k: v for k, v in prompt["4"]["inputs"].items() if k != "image"},
        "video_path": "example.png", "filename_prefix": "", "codec": "h264"}}
    host = HeadlessHost(model_dir=tiny_model_dir, input_dir=inputs, output_dir=tmp_path,
                        quiet=True)
    try:
        result = run_workflow(prompt, host=host)
    finally:
        MODEL_CACHE.clear()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in result.files) == [
        "ComfyUI_00001_.png", "SeedVR2/video_00001_.png"]


# ---------------------------------------------------------------------------------------------
# numz's own workflows of every layout (v2.0-2.4's SeedVR2 node of each date, v2.5's nodes),
# with any values numz's nodes accepted then (their widget ranges, from numz's
# comfyui_node.py of each date and src/interfaces/ of v2.5.24): each converts and runs. The
# upscale itself is left out (the facade returns its input): every check of the prompt, the
# loaders' settings and the job's options runs; test_numz runs real upscales.


def _numz_ranges(date: str) -> dict:
    """numz's widget ranges on ``date`` (tile sizes were 256-2048 in steps of 256 until 19
    August 2025, then from 64 in steps of 32 without a maximum)."""
    early = date < "2025-08-19"
    return dict(
        model=st.just("dit3b_tiny.safetensors"), seed=st.integers(0, 2**32 - 1),
        new_resolution=st.sampled_from([16, 32]),  # (numz: 16 to 4320; small for the CPU)
        batch_size=st.sampled_from([1, 5, 9]), color_correction=st.sampled_from(
            ["wavelet", "adain", "none"]),
        cond_noise_scale=st.floats(0, 1), input_noise_scale=st.floats(0, 1),
        latent_noise_scale=st.floats(0, 1), blocks_to_swap=st.integers(0, 36),
        use_non_blocking=st.booleans(), offload_io_components=st.booleans(),
        tiled_vae=st.booleans(),
        vae_tile_size=st.integers(1, 8).map(lambda n: 256 * n) if early else
        st.integers(2, 64).map(lambda n: 32 * n),
        vae_tile_overlap=st.integers(0, 4).map(lambda n: 64 * n) if early else
        st.integers(0, 64).map(lambda n: 32 * n),
        preserve_vram=st.booleans(), cache_model=st.booleans(), enable_debug=st.booleans(),
        device=st.just("cpu"))


@st.composite
def _numz_v2_5_values(draw) -> dict:
    """numz v2.5.24's widget ranges; BlockSwap and cache_model need an offload device there
    (numz refuses them without one)."""
    tiles = {f"{stage}_{key}": st.integers(*span).map(lambda n: 32 * n)
             for stage in ("encode", "decode")
             for key, span in (("tile_size", (2, 64)), ("tile_overlap", (0, 64)))}
    dit = draw(st.fixed_dictionaries(dict(
        model=st.just("dit3b_tiny.safetensors"), device=st.just("cpu"),
        blocks_to_swap=st.integers(0, 36), swap_io_components=st.booleans(),
        offload_device=st.sampled_from(["none", "cpu"]), cache_model=st.booleans(),
        attention_mode=st.sampled_from(["sdpa", "flash_attn_2", "flash_attn_3", "sageattn_2",
                                        "sageattn_3"]))))
    if dit["blocks_to_swap"] or dit["swap_io_components"] or dit["cache_model"]:
        dit["offload_device"] = "cpu"
    vae = draw(st.fixed_dictionaries(dict(
        model=st.just("vae_tiny.safetensors"), device=st.just("cpu"),
        encode_tiled=st.booleans(), decode_tiled=st.booleans(), **tiles,
        tile_debug=st.sampled_from(["false", "encode", "decode"]),
        offload_device=st.sampled_from(["none", "cpu"]), cache_model=st.booleans())))
    if vae["cache_model"]:
        vae["offload_device"] = "cpu"
    upscaler = draw(st.fixed_dictionaries(dict(
        seed=st.integers(0, 2**32 - 1), resolution=st.sampled_from([16, 32]),
        # (a max_resolution under 16 px on the short edge is refused here, named)
        max_resolution=st.sampled_from([0, 64, 128]), batch_size=st.sampled_from([1, 5, 9]),
        uniform_batch_size=st.booleans(), temporal_overlap=st.integers(0, 16),
        prepend_frames=st.integers(0, 32),
        color_correction=st.sampled_from(["lab", "wavelet", "wavelet_adaptive", "hsv", "adain",
                                          "none"]),
        input_noise_scale=st.floats(0, 1), latent_noise_scale=st.floats(0, 1),
        offload_device=st.sampled_from(["none", "cpu"]), enable_debug=st.booleans())))
    return {"SeedVR2LoadDiTModel": dit, "SeedVR2LoadVAEModel": vae,
            "SeedVR2VideoUpscaler": upscaler}


@st.composite
def numz_accepted(draw):
    """(layout, values, editor format or not)."""
    date = draw(st.sampled_from([*sorted(OLD_SEEDVR2), "v2.5.24"]))
    values = draw(_numz_v2_5_values() if date == "v2.5.24" else
                  st.fixed_dictionaries(_numz_ranges(date)))
    return date, values, draw(st.booleans())


def numz_workflow(date: str, values: dict, editor: bool) -> dict:
    if date == "v2.5.24":
        return numz_ui_workflow(values=values) if editor else numz_api_prompt(values=values)
    return (old_ui_workflow if editor else old_api_prompt)(date, values)


@given(case=numz_accepted())
def test_numz_workflows_with_values_numz_accepted_run(case, tiny_model_dir, inputs,
                                                      tmp_path_factory, monkeypatch):
    import seedvr2.api
    from seedvr2.workflow.run import run_workflow

    workflow = numz_workflow(*case)
    monkeypatch.setattr(seedvr2.api, "upscale", lambda frames, *args, **kwargs: frames)
    host = HeadlessHost(model_dir=tiny_model_dir, input_dir=inputs,
                        output_dir=tmp_path_factory.mktemp("numz"), quiet=True)
    monkeypatch.setattr(host, "after_run", lambda: None)  # (nothing loaded: nothing to free)
    result = run_workflow(workflow, host=host)
    assert len(result.files) == 1
    for note in result.warnings:  # what has no place here, or what numz did by itself
        assert note.startswith("node ") and "): numz's " in note, note


# ---------------------------------------------------------------------------------------------
# seedvr2 run-workflow --server: the same readers, and the uploads of input files


@pytest.fixture(scope="module")
def fake_comfy():
    from test_hostile_inputs import FakeComfy

    with FakeComfy([]) as fake:
        yield fake


@given(workflow=st.one_of(any_workflow, st.builds(
    lambda image: {"1": {"class_type": "LoadImage", "inputs": {"image": image}},
                   "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}}},
    st.one_of(input_values, st.sampled_from(["mine.png", "../secret.png", "sub/../../secret.png",
                                             "mine.png\x00", " ../secret.png"])))))
@settings(max_examples=max(10, settings.default.max_examples // 2))
def test_run_workflow_on_a_server_sends_a_prompt_or_one_error_line(workflow, fake_comfy,
                                                                   tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    (folder / "in").mkdir()
    (folder / "in" / "mine.png").write_bytes(b"PNG")
    (folder / "secret.png").write_bytes(b"SECRET")
    path = folder / "workflow.json"
    path.write_bytes(dumps(workflow))
    uploads = len(fake_comfy.uploads)
    run = run_cli(["run-workflow", str(path), "--server", fake_comfy.url, "-q", "--input-dir",
                   str(folder / "in"), "--output-dir", str(folder / "out")])
    if run.status:
        assert run.status == 1 and run.stderr.startswith("error: "), run.stderr
        assert run.stderr.count("\n") == 1, run.stderr
    assert not any(b"SECRET" in body for body in fake_comfy.uploads[uploads:])
