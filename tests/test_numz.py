"""Workflows saved with the numz pack (v2.5.24) open and run as ours.

The workflows are written here from numz v2.5.24's node definitions (the facts below: each
node's inputs in declaration order, its widget types and its outputs), in both formats the
numz pack's users have: the editor's (positional widget values, with or without the widget
names newer editors write into ``inputs``) and the API's (inputs by numz's names).
"""

from __future__ import annotations

import json

import pytest

from example_workflows import EXAMPLE_IMAGE
from test_workflows import IMAGE_OUT, inputs, make_inputs  # noqa: F401 (fixture)

from seedvr2.cli import main
from seedvr2.workflow.convert import ui_to_api
from seedvr2.workflow.errors import WorkflowError
from seedvr2.workflow.host import HeadlessHost
from seedvr2.workflow.numz import translate_prompt
from seedvr2.workflow.run import builtin_object_info, run_workflow

# numz v2.5.24 (src/interfaces/*.py): node -> inputs in declaration order as (name, type,
# optional), and the node's output type. The editor lists required inputs first, then optional
# ones; an INT named seed gets a "control after generate" value after it.
NUMZ_V2_5_24 = {
    "SeedVR2LoadDiTModel": ([
        ("model", "COMBO", False), ("device", "COMBO", False),
        ("blocks_to_swap", "INT", True), ("swap_io_components", "BOOLEAN", True),
        ("offload_device", "COMBO", True), ("cache_model", "BOOLEAN", True),
        ("attention_mode", "COMBO", True), ("torch_compile_args", "TORCH_COMPILE_ARGS", True),
    ], "SEEDVR2_DIT"),
    "SeedVR2LoadVAEModel": ([
        ("model", "COMBO", False), ("device", "COMBO", False),
        ("encode_tiled", "BOOLEAN", True), ("encode_tile_size", "INT", True),
        ("encode_tile_overlap", "INT", True), ("decode_tiled", "BOOLEAN", True),
        ("decode_tile_size", "INT", True), ("decode_tile_overlap", "INT", True),
        ("tile_debug", "COMBO", True), ("offload_device", "COMBO", True),
        ("cache_model", "BOOLEAN", True), ("torch_compile_args", "TORCH_COMPILE_ARGS", True),
    ], "SEEDVR2_VAE"),
    "SeedVR2TorchCompileSettings": ([
        ("backend", "COMBO", False), ("mode", "COMBO", False), ("fullgraph", "BOOLEAN", False),
        ("dynamic", "BOOLEAN", False), ("dynamo_cache_size_limit", "INT", False),
        ("dynamo_recompile_limit", "INT", False),
    ], "TORCH_COMPILE_ARGS"),
    "SeedVR2VideoUpscaler": ([
        ("image", "IMAGE", False), ("dit", "SEEDVR2_DIT", False), ("vae", "SEEDVR2_VAE", False),
        ("seed", "INT", False), ("resolution", "INT", False), ("max_resolution", "INT", False),
        ("batch_size", "INT", False), ("uniform_batch_size", "BOOLEAN", False),
        ("temporal_overlap", "INT", True), ("prepend_frames", "INT", True),
        ("color_correction", "COMBO", False), ("input_noise_scale", "FLOAT", True),
        ("latent_noise_scale", "FLOAT", True), ("offload_device", "COMBO", True),
        ("enable_debug", "BOOLEAN", True),
    ], "IMAGE"),
}
WIDGETS = ("INT", "FLOAT", "BOOLEAN", "STRING", "COMBO")

# The values a numz user saved (none of them our default, where the input has a counterpart).
NUMZ_VALUES = {
    "SeedVR2LoadDiTModel": dict(model="dit3b_tiny.safetensors", device="cpu", blocks_to_swap=0,
                                swap_io_components=False, offload_device="cpu", cache_model=True,
                                attention_mode="sdpa"),
    "SeedVR2LoadVAEModel": dict(model="vae_tiny.safetensors", device="cpu", encode_tiled=True,
                                encode_tile_size=96, encode_tile_overlap=32, decode_tiled=True,
                                decode_tile_size=128, decode_tile_overlap=32, tile_debug="encode",
                                offload_device="cpu", cache_model=False),
    "SeedVR2TorchCompileSettings": dict(backend="inductor", mode="max-autotune", fullgraph=True,
                                        dynamic=False, dynamo_cache_size_limit=32,
                                        dynamo_recompile_limit=100),
    "SeedVR2VideoUpscaler": dict(seed=7, resolution=64, max_resolution=100, batch_size=9,
                                 uniform_batch_size=True, temporal_overlap=2, prepend_frames=1,
                                 color_correction="lab", input_noise_scale=0.1,
                                 latent_noise_scale=0.05, offload_device="cpu",
                                 enable_debug=True),
}
# Where each numz value lands here (input renamed), and numz inputs with no counterpart.
OURS = {"attention_mode": "attention_backend"}
DROPPED = {"tile_debug", "enable_debug"}


def numz_widget_order(node_type: str) -> list[str]:
    inputs, _ = NUMZ_V2_5_24[node_type]
    widgets = [(name, optional) for name, kind, optional in inputs if kind in WIDGETS]
    return [n for n, opt in widgets if not opt] + [n for n, opt in widgets if opt]


def _numz_node(node_id, node_type, values, links_in, links_out, *, names=True, order=None):
    """A node as the editor saves it with the numz pack loaded."""
    inputs, output = NUMZ_V2_5_24[node_type]
    order = order or numz_widget_order(node_type)
    widgets_values = []
    for name in order:
        widgets_values.append(values[name])
        if name == "seed":
            widgets_values.append("fixed")
    slots = [{"name": name, "type": kind, "link": links_in.get(name)}
             for name, kind, _ in inputs if kind not in WIDGETS]
    if names:  # newer editors give every widget a slot too, in the widgets' order
        slots += [{"name": name, "type": dict((n, k) for n, k, _ in inputs)[name],
                   "widget": {"name": name}, "link": None} for name in order]
    return {"id": node_id, "type": node_type, "pos": [400 * node_id, 100], "size": [300, 200],
            "flags": {}, "order": node_id, "mode": 0, "inputs": slots,
            "outputs": [{"name": output, "type": output, "links": links_out}],
            "properties": {"Node name for S&R": node_type, "cnr_id": "seedvr2_videoupscaler",
                           "ver": "2.5.24"},
            "widgets_values": widgets_values}


def _load_image_node(image: str) -> dict:
    """The editor's LoadImage node 1, its IMAGE on link 1."""
    return {"id": 1, "type": "LoadImage", "pos": [0, 100], "size": [300, 300], "flags": {},
            "order": 0, "mode": 0, "inputs": [],
            "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]},
                        {"name": "MASK", "type": "MASK", "links": []}],
            "properties": {"Node name for S&R": "LoadImage"}, "widgets_values": [image, "image"]}


def numz_ui_workflow(*, names=True, compile_args=False, dit_order=None, image=EXAMPLE_IMAGE,
                     values=NUMZ_VALUES) -> dict:
    """LoadImage -> numz's loaders and upscaler -> SaveImage, as numz v2.5.24 saves it."""
    links = [[1, 1, 0, 4, 0, "IMAGE"], [2, 2, 0, 4, 1, "SEEDVR2_DIT"],
             [3, 3, 0, 4, 2, "SEEDVR2_VAE"], [4, 4, 0, 6, 0, "IMAGE"]]
    nodes = [
        _load_image_node(image),
        _numz_node(2, "SeedVR2LoadDiTModel", values["SeedVR2LoadDiTModel"],
                   {"torch_compile_args": 5 if compile_args else None}, [2], names=names,
                   order=dit_order),
        _numz_node(3, "SeedVR2LoadVAEModel", values["SeedVR2LoadVAEModel"], {}, [3],
                   names=names),
        _numz_node(4, "SeedVR2VideoUpscaler", values["SeedVR2VideoUpscaler"],
                   {"image": 1, "dit": 2, "vae": 3}, [4], names=names),
        {"id": 6, "type": "SaveImage", "pos": [2000, 100], "size": [300, 300], "flags": {},
         "order": 6, "mode": 0, "inputs": [{"name": "images", "type": "IMAGE", "link": 4}],
         "outputs": [], "properties": {"Node name for S&R": "SaveImage"},
         "widgets_values": ["numz/image"]},
    ]
    if compile_args:
        links.append([5, 5, 0, 2, 0, "TORCH_COMPILE_ARGS"])
        nodes.append(_numz_node(5, "SeedVR2TorchCompileSettings",
                                values["SeedVR2TorchCompileSettings"], {}, [5], names=names))
    return {"last_node_id": 6, "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {}, "version": 0.4}


def numz_api_prompt(image=EXAMPLE_IMAGE, values=NUMZ_VALUES) -> dict:
    """The same workflow in the API format numz's users export (numz's input names)."""
    def node(kind, **links):
        return {"class_type": kind, "inputs": {**values[kind], **links}}
    return {"1": {"class_type": "LoadImage", "inputs": {"image": image}},
            "2": node("SeedVR2LoadDiTModel"), "3": node("SeedVR2LoadVAEModel"),
            "4": node("SeedVR2VideoUpscaler", image=["1", 0], dit=["2", 0], vae=["3", 0]),
            "6": {"class_type": "SaveImage", "inputs": {"images": ["4", 0],
                                                        "filename_prefix": "numz/image"}}}


def expected_inputs(node_type: str, info: dict) -> dict:
    """Our inputs after opening numz's node: each numz value on the input of the same meaning;
    our inputs numz has no counterpart for at their defaults."""
    from seedvr2.workflow.numz import widget_inputs

    values = {OURS.get(k, k): v for k, v in NUMZ_VALUES[node_type].items() if k not in DROPPED}
    if node_type == "SeedVR2TorchCompileSettings":
        values["dynamic"] = "false"  # numz's switch; ours adds "auto"
    return {w.name: values.get(w.name, w.default) for w in widget_inputs(info[node_type])}


def _info(tmp_path):
    return builtin_object_info(HeadlessHost(model_dir=tmp_path))


@pytest.fixture
def empty_model_cache():
    """The numz DiT loader keeps its model (cache_model): dropped after the test."""
    from seedvr2.memory import MODEL_CACHE

    yield
    MODEL_CACHE.clear()


NUMZ_TYPES = list(NUMZ_V2_5_24)


@pytest.mark.parametrize("names", [True, False], ids=["widget-names", "positional"])
def test_numz_editor_workflow_puts_every_value_on_our_input_of_the_same_meaning(names, tmp_path):
    info = _info(tmp_path)
    notes = []
    api = ui_to_api(numz_ui_workflow(names=names, compile_args=True), info, notes.append)
    for node_id, node_type in (("2", "SeedVR2LoadDiTModel"), ("3", "SeedVR2LoadVAEModel"),
                               ("5", "SeedVR2TorchCompileSettings"),
                               ("4", "SeedVR2VideoUpscaler")):
        widgets = {k: v for k, v in api[node_id]["inputs"].items() if not isinstance(v, list)}
        assert widgets == expected_inputs(node_type, info), node_type
    assert api["2"]["inputs"]["torch_compile_args"] == ["5", 0]
    assert api["4"]["inputs"]["image"] == ["1", 0]
    assert (api["4"]["inputs"]["dit"], api["4"]["inputs"]["vae"]) == (["2", 0], ["3", 0])
    assert notes == [
        "node 3 (SeedVR2LoadVAEModel): numz's tile_debug = 'encode' has no equivalent in this "
        "pack; dropped",
        "node 4 (SeedVR2VideoUpscaler): numz's enable_debug = True has no equivalent in this "
        "pack; dropped"]


def test_numz_links_follow_their_inputs_and_take_our_types(tmp_path):
    from seedvr2.workflow.numz import translate_workflow

    workflow, _ = translate_workflow(numz_ui_workflow(compile_args=True), _info(tmp_path))
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link for link in workflow["links"]}
    dit_inputs = [i["name"] for i in nodes[2]["inputs"]]
    slot = dit_inputs.index("torch_compile_args")
    assert links[5] == [5, 5, 0, 2, slot, "SEEDVR2_TORCH_COMPILE_ARGS"]
    assert nodes[2]["inputs"][slot]["type"] == "SEEDVR2_TORCH_COMPILE_ARGS"
    assert nodes[5]["outputs"][0]["type"] == "SEEDVR2_TORCH_COMPILE_ARGS"
    assert [i["name"] for i in nodes[4]["inputs"] if "widget" not in i] == ["image", "dit", "vae"]
    assert "attention_backend" in dit_inputs and "attention_mode" not in dit_inputs


def test_widget_names_decide_over_numz_v2_5_24_order(tmp_path):
    """numz changed its input order between releases: a file with widget names is read by
    them (here the DiT loader of an older order, offload_device before blocks_to_swap)."""
    info = _info(tmp_path)
    older = ["model", "device", "offload_device", "cache_model", "blocks_to_swap",
             "swap_io_components", "attention_mode"]
    api = ui_to_api(numz_ui_workflow(dit_order=older), info)
    widgets = {k: v for k, v in api["2"]["inputs"].items() if not isinstance(v, list)}
    assert widgets == expected_inputs("SeedVR2LoadDiTModel", info)
    # An input another release had, named in the file, is dropped with a note.
    workflow = numz_ui_workflow()
    dit = next(n for n in workflow["nodes"] if n["id"] == 2)
    dit["inputs"].append({"name": "preserve_vram", "type": "BOOLEAN",
                          "widget": {"name": "preserve_vram"}, "link": None})
    dit["widgets_values"].append(True)
    notes = []
    api = ui_to_api(workflow, info, notes.append)
    widgets = {k: v for k, v in api["2"]["inputs"].items() if not isinstance(v, list)}
    assert widgets == expected_inputs("SeedVR2LoadDiTModel", info)
    assert notes == ["node 2 (SeedVR2LoadDiTModel): numz's preserve_vram = True has no "
                     "equivalent in this pack; dropped", *notes[1:]]


def test_numz_new_resolution_is_our_resolution(tmp_path):
    """numz's commits of late October 2025 call resolution new_resolution."""
    info = _info(tmp_path)
    workflow = numz_ui_workflow()
    upscaler = next(n for n in workflow["nodes"] if n["id"] == 4)
    (slot,) = [i for i in upscaler["inputs"] if i.get("widget") == {"name": "resolution"}]
    slot["name"], slot["widget"] = "new_resolution", {"name": "new_resolution"}
    notes = []
    api = ui_to_api(workflow, info, notes.append)
    widgets = {k: v for k, v in api["4"]["inputs"].items() if not isinstance(v, list)}
    assert widgets == expected_inputs("SeedVR2VideoUpscaler", info)
    assert not any("new_resolution" in note for note in notes)
    prompt = numz_api_prompt()
    prompt["4"]["inputs"]["new_resolution"] = prompt["4"]["inputs"].pop("resolution")
    translated, notes = translate_prompt(prompt, info)
    resolution = NUMZ_VALUES["SeedVR2VideoUpscaler"]["resolution"]
    assert translated["4"]["inputs"]["resolution"] == resolution
    assert not any("new_resolution" in note for note in notes)


def test_a_choice_numz_has_and_we_do_not_takes_our_default_with_a_note(tmp_path):
    info = _info(tmp_path)
    workflow = numz_ui_workflow()
    dit = next(n for n in workflow["nodes"] if n["id"] == 2)
    dit["widgets_values"][-1] = "sageattn_3"
    vae = next(n for n in workflow["nodes"] if n["id"] == 3)
    vae["widgets_values"][numz_widget_order("SeedVR2LoadVAEModel").index("tile_debug")] = "false"
    upscaler = next(n for n in workflow["nodes"] if n["id"] == 4)
    upscaler["widgets_values"][-1] = False  # enable_debug off
    notes = []
    api = ui_to_api(workflow, info, notes.append)
    assert api["2"]["inputs"]["attention_backend"] == "auto"
    # numz's debug switches left off lose nothing when dropped: no note for them.
    assert notes == ["node 2 (SeedVR2LoadDiTModel): numz's attention_mode = 'sageattn_3' is "
                     "not available in this pack (choices: auto, sdpa, flash_attn_2, "
                     "flash_attn_3, sageattn_2); using 'auto'"]


def test_a_number_outside_our_range_takes_our_default_with_a_note(tmp_path):
    """numz's compile cache limits start at 0, ours at 1."""
    prompt = {"5": {"class_type": "SeedVR2TorchCompileSettings",
                    "inputs": {**NUMZ_VALUES["SeedVR2TorchCompileSettings"],
                               "dynamo_cache_size_limit": 0}}}
    translated, notes = translate_prompt(prompt, _info(tmp_path))
    assert translated["5"]["inputs"]["dynamo_cache_size_limit"] == 64
    assert translated["5"]["inputs"]["dynamic"] == "false"
    assert notes == ["node 5 (SeedVR2TorchCompileSettings): numz's dynamo_cache_size_limit = 0 "
                     "is outside this pack's range (1 to 1024); using 64"]


def test_numz_prompts_are_told_from_ours_without_object_info():
    from test_workflows import API_DIR

    from seedvr2.workflow.numz import has_numz_nodes

    assert has_numz_nodes(numz_api_prompt())
    compile_only = {"5": {"class_type": "SeedVR2TorchCompileSettings",
                          "inputs": NUMZ_VALUES["SeedVR2TorchCompileSettings"]}}
    assert has_numz_nodes(compile_only)
    for path in API_DIR.glob("*.json"):
        assert not has_numz_nodes(json.loads(path.read_text())), path.name


def test_our_own_saved_workflows_are_left_as_they_are(tmp_path):
    from test_workflows import EXAMPLES_DIR

    from seedvr2.workflow.numz import translate_workflow

    for path in EXAMPLES_DIR.glob("*.json"):
        workflow = json.loads(path.read_text())
        assert translate_workflow(workflow, _info(tmp_path)) == (workflow, []), path.name


def test_numz_editor_workflow_runs_headless(tiny_model_dir, inputs, tmp_path, capsys,
                                            empty_model_cache):
    from PIL import Image

    path = tmp_path / "numz.json"
    path.write_text(json.dumps(numz_ui_workflow(image=EXAMPLE_IMAGE)))
    rc = main(["run-workflow", str(path), "--model-dir", str(tiny_model_dir), "--input-dir",
               str(inputs), "--output-dir", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().err
    (saved,) = (tmp_path / "out" / "numz").glob("*.png")
    with Image.open(saved) as im:
        assert im.size == IMAGE_OUT


def test_numz_api_prompt_runs_headless_with_every_value_in_its_place(tiny_model_dir, inputs,
                                                                    tmp_path, capsys,
                                                                    empty_model_cache):
    from PIL import Image

    host = HeadlessHost(model_dir=tiny_model_dir, input_dir=inputs, output_dir=tmp_path / "out",
                        quiet=True)
    result = run_workflow(numz_api_prompt(image=EXAMPLE_IMAGE), host=host)
    info = builtin_object_info(host)
    for node_id, node_type in (("2", "SeedVR2LoadDiTModel"), ("3", "SeedVR2LoadVAEModel"),
                               ("4", "SeedVR2VideoUpscaler")):
        widgets = {k: v for k, v in result.prompt[node_id]["inputs"].items()
                   if not isinstance(v, list)}
        assert widgets == expected_inputs(node_type, info), node_type
    assert result.warnings[:2] == [
        "node 3 (SeedVR2LoadVAEModel): numz's tile_debug = 'encode' has no equivalent in this "
        "pack; dropped",
        "node 4 (SeedVR2VideoUpscaler): numz's enable_debug = True has no equivalent in this "
        "pack; dropped"]
    (saved,) = result.files
    with Image.open(saved) as im:
        assert im.size == IMAGE_OUT

    # The same prompt from a file, with `seedvr2 run-workflow`.
    path = tmp_path / "numz_api.json"
    path.write_text(json.dumps(numz_api_prompt(image=EXAMPLE_IMAGE)))
    rc = main(["run-workflow", str(path), "--model-dir", str(tiny_model_dir), "--input-dir",
               str(inputs), "--output-dir", str(tmp_path / "cli")])
    assert rc == 0, capsys.readouterr().err
    assert len(list((tmp_path / "cli" / "numz").glob("*.png"))) == 1


def test_another_pack_with_our_node_ids_is_named_with_both_folders():
    from conftest import import_pack

    clashing_packs = import_pack("seedvr2_pack_clashes").clashing_packs

    class Theirs:
        RELATIVE_PYTHON_MODULE = "custom_nodes.ComfyUI-SeedVR2_VideoUpscaler"

    class Ours:
        RELATIVE_PYTHON_MODULE = "custom_nodes.ComfyUI-SeedVR2"

    ids = ("SeedVR2LoadDiTModel", "SeedVR2UpscaleVideoFile")
    mappings = {"SeedVR2LoadDiTModel": Theirs, "SeedVR2UpscaleVideoFile": Ours}
    dirs = {"ComfyUI-SeedVR2_VideoUpscaler": "/c/custom_nodes/ComfyUI-SeedVR2_VideoUpscaler",
            "ComfyUI-SeedVR2": "/c/custom_nodes/ComfyUI-SeedVR2"}

    assert clashing_packs(ids, mappings, dirs, Ours.RELATIVE_PYTHON_MODULE, loading=False) == [
        "two packs register the node IDs SeedVR2LoadDiTModel: "
        "/c/custom_nodes/ComfyUI-SeedVR2_VideoUpscaler registers SeedVR2LoadDiTModel; this "
        "pack, /c/custom_nodes/ComfyUI-SeedVR2, registers SeedVR2LoadDiTModel, "
        "SeedVR2UpscaleVideoFile. ComfyUI keeps the pack loaded last: "
        "custom_nodes.ComfyUI-SeedVR2_VideoUpscaler's replaced this pack's. Remove one of them "
        "(this pack also opens numz's workflows)."]
    assert clashing_packs(ids, {"SeedVR2LoadDiTModel": Ours}, dirs, Ours.RELATIVE_PYTHON_MODULE,
                          loading=True) == []


def test_numz_pack_loaded_first_is_named_in_the_log_when_ours_load(tmp_path):
    """ComfyUI (classic path here: no comfy_api) with numz's nodes registered before ours: our
    pack's import logs both folders and what each registers."""
    from conftest import import_pack_beside

    numz_dir = tmp_path / "custom_nodes" / "ComfyUI-SeedVR2_VideoUpscaler"
    ours, result = import_pack_beside(tmp_path, """
        # ComfyUI's, after loading the numz pack
        numz = type("SeedVR2LoadDiTModel", (), {
            "RELATIVE_PYTHON_MODULE": "custom_nodes.ComfyUI-SeedVR2_VideoUpscaler"})
        nodes.NODE_CLASS_MAPPINGS = {"SeedVR2LoadDiTModel": numz, "SeedVR2VideoUpscaler": numz}
    """, {"ComfyUI-SeedVR2_VideoUpscaler": numz_dir})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"SeedVR2: two packs register the node IDs SeedVR2LoadDiTModel, SeedVR2VideoUpscaler: "
        f"{numz_dir} registers SeedVR2LoadDiTModel, SeedVR2VideoUpscaler; this pack, {ours}, "
        f"registers SeedVR2LoadDiTModel, SeedVR2LoadVAEModel, SeedVR2TorchCompileSettings, "
        f"SeedVR2VideoUpscaler, SeedVR2UpscaleVideoFile, SeedVR2UpscaleVideo. ComfyUI keeps "
        f"the pack loaded last: this pack's replace custom_nodes.ComfyUI-SeedVR2_VideoUpscaler's. "
        f"Remove one of them (this pack also opens numz's workflows)."]


# ---------------------------------------------------------------------------------------------
# numz v2.0-2.4 (August to early October 2025): the single SeedVR2 node, fed by SeedVR2BlockSwap
# and SeedVR2ExtraArgs. Layouts from numz's src/interfaces/comfyui_node.py of each date: widget
# inputs in declaration order (all required), then the sockets (images; block_swap_config and
# extra_args, optional).
OLD_SEEDVR2 = {
    "2025-08-13": ["model", "seed", "new_resolution", "batch_size", "preserve_vram",
                   "cache_model", "enable_debug", "tiled_vae", "vae_tile_size",
                   "vae_tile_overlap"],
    "2025-08-15": ["model", "seed", "new_resolution", "batch_size"],
    "2025-09-16": ["model", "seed", "new_resolution", "batch_size", "color_correction"],
    "2025-09-18": ["model", "seed", "new_resolution", "batch_size", "color_correction",
                   "cond_noise_scale"],
    "2025-09-22": ["model", "seed", "new_resolution", "batch_size", "color_correction",
                   "input_noise_scale", "latent_noise_scale"],
}
OLD_BLOCKSWAP = {"2025-08-13": ["blocks_to_swap", "use_non_blocking", "offload_io_components"],
                 "2025-09-16": ["blocks_to_swap", "offload_io_components"]}
OLD_EXTRA_ARGS = ["tiled_vae", "vae_tile_size", "vae_tile_overlap", "preserve_vram",
                  "cache_model", "enable_debug", "device"]
# What a numz user saved (none of it our default).
OLD_VALUES = dict(model="dit3b_tiny.safetensors", seed=7, new_resolution=64, batch_size=9,
                  color_correction="adain", cond_noise_scale=0.05, input_noise_scale=0.1,
                  latent_noise_scale=0.05, blocks_to_swap=2, use_non_blocking=True,
                  offload_io_components=True, tiled_vae=True, vae_tile_size=256,
                  vae_tile_overlap=32, preserve_vram=True, cache_model=True, enable_debug=True,
                  device="cpu")


def _old_layout_of(date: str):
    """(SeedVR2 widgets, BlockSwap widgets, ExtraArgs widgets or None) of numz on ``date``."""
    blockswap = OLD_BLOCKSWAP["2025-09-16" if date >= "2025-09-16" else "2025-08-13"]
    return OLD_SEEDVR2[date], blockswap, (OLD_EXTRA_ARGS if date >= "2025-08-15" else None)


def old_ui_workflow(date: str, values=OLD_VALUES, image=EXAMPLE_IMAGE) -> dict:
    """LoadImage -> SeedVR2 (with its config nodes) -> SaveImage, as numz saved it then."""
    upscaler, blockswap, extra = _old_layout_of(date)
    links = [[1, 1, 0, 4, 0, "IMAGE"], [2, 4, 0, 6, 0, "IMAGE"], [3, 2, 0, 4, 1,
                                                                  "block_swap_config"]]
    sockets = [{"name": "images", "type": "IMAGE", "link": 1},
               {"name": "block_swap_config", "type": "block_swap_config", "link": 3}]

    def config(node_id, kind, names, output):
        return {"id": node_id, "type": kind, "pos": [0, 400 * node_id], "size": [300, 200],
                "flags": {}, "order": node_id, "mode": 0, "inputs": [],
                "outputs": [{"name": output, "type": output, "links": [node_id + 1]}],
                "properties": {"Node name for S&R": kind},
                "widgets_values": [values[n] for n in names]}
    nodes = [
        _load_image_node(image),
        config(2, "SeedVR2BlockSwap", blockswap, "block_swap_config"),
        {"id": 4, "type": "SeedVR2", "pos": [800, 100], "size": [300, 300], "flags": {},
         "order": 4, "mode": 0, "inputs": sockets,
         "outputs": [{"name": "image", "type": "IMAGE", "links": [2]}],
         "properties": {"Node name for S&R": "SeedVR2"},
         "widgets_values": [v for n in upscaler
                            for v in ([values[n], "fixed"] if n == "seed" else [values[n]])]},
        {"id": 6, "type": "SaveImage", "pos": [1200, 100], "size": [300, 300], "flags": {},
         "order": 6, "mode": 0, "inputs": [{"name": "images", "type": "IMAGE", "link": 2}],
         "outputs": [], "properties": {"Node name for S&R": "SaveImage"},
         "widgets_values": ["numz/old"]},
    ]
    if extra is not None:
        nodes.append(config(3, "SeedVR2ExtraArgs", extra, "extra_args"))
        sockets.append({"name": "extra_args", "type": "extra_args", "link": 4})
        links.append([4, 3, 0, 4, 2, "extra_args"])
    return {"last_node_id": 6, "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {}, "version": 0.4}


def old_api_prompt(date: str, values=OLD_VALUES, image=EXAMPLE_IMAGE) -> dict:
    upscaler, blockswap, extra = _old_layout_of(date)
    prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": image}},
              "2": {"class_type": "SeedVR2BlockSwap", "inputs": {n: values[n] for n in blockswap}},
              "4": {"class_type": "SeedVR2", "inputs": {
                  **{n: values[n] for n in upscaler}, "images": ["1", 0],
                  "block_swap_config": ["2", 0]}},
              "6": {"class_type": "SaveImage", "inputs": {"images": ["4", 0],
                                                          "filename_prefix": "numz/old"}}}
    if extra is not None:
        prompt["3"] = {"class_type": "SeedVR2ExtraArgs", "inputs": {n: values[n] for n in extra}}
        prompt["4"]["inputs"]["extra_args"] = ["3", 0]
    return prompt


def old_expected(date: str, info: dict, values=OLD_VALUES) -> dict:
    """Our three nodes' widget inputs after opening numz's: each saved value on the input of
    the same meaning, our defaults elsewhere."""
    from seedvr2.workflow.numz import widget_inputs

    saved = {n for names in _old_layout_of(date) if names for n in names}
    both = lambda a, b: {a: values[b]} if b in saved else {}  # noqa: E731
    dit = {**both("model", "model"), **both("blocks_to_swap", "blocks_to_swap"),
           **both("swap_io_components", "offload_io_components"),
           **both("cache_model", "cache_model"), **both("device", "device"),
           **({"offload_device": "cpu"} if "preserve_vram" in saved else {})}
    vae = {**{f"{side}_tiled": values["tiled_vae"] for side in ("encode", "decode")},
           **{f"{side}_tile_size": values["vae_tile_size"] for side in ("encode", "decode")},
           **{f"{side}_tile_overlap": values["vae_tile_overlap"] for side in ("encode", "decode")},
           **both("cache_model", "cache_model"), **both("device", "device"),
           **({"offload_device": "cpu"} if "preserve_vram" in saved else {})}
    upscaler = {**both("seed", "seed"), **both("resolution", "new_resolution"),
                **both("batch_size", "batch_size"), **both("color_correction", "color_correction"),
                **both("input_noise_scale", "input_noise_scale"),
                **both("latent_noise_scale", "latent_noise_scale"),
                **both("latent_noise_scale", "cond_noise_scale")}
    return {kind: {w.name: ours.get(w.name, w.default) for w in widget_inputs(info[kind])}
            for kind, ours in (("SeedVR2LoadDiTModel", dit), ("SeedVR2LoadVAEModel", vae),
                               ("SeedVR2VideoUpscaler", upscaler))}


def _old_notes(date: str, node_id) -> list[str]:
    """Notes on the switches left on with no equivalent: the SeedVR2 node's, then its
    config nodes' (BlockSwap's, then ExtraArgs')."""
    names = [n for layout in _old_layout_of(date) for n in layout or ()]
    return [f"node {node_id} (SeedVR2): numz's {name} = True has no equivalent in this pack; "
            f"dropped" for name in names if name in ("enable_debug", "use_non_blocking")]


def _by_class(prompt: dict) -> dict:
    """class type -> its widget inputs (links left out), for a prompt with one of each."""
    return {node["class_type"]: {k: v for k, v in node["inputs"].items()
                                 if not isinstance(v, list)} for node in prompt.values()}


@pytest.mark.parametrize("date", list(OLD_SEEDVR2))
def test_numz_v2_0_to_2_4_workflows_become_our_three_nodes(date, tmp_path):
    from seedvr2.workflow.numz import has_numz_nodes

    info = _info(tmp_path)
    expected = old_expected(date, info)
    # The editor's format (opened in the editor, and converted by run-workflow).
    notes = []
    api = ui_to_api(old_ui_workflow(date), info, notes.append)
    assert {k: v for k, v in _by_class(api).items() if k.startswith("SeedVR2")} == expected
    upscaler = next(n for n in api.values() if n["class_type"] == "SeedVR2VideoUpscaler")
    assert upscaler["inputs"]["image"] == ["1", 0] and api["6"]["inputs"]["images"] == ["4", 0]
    for role, kind in (("dit", "SeedVR2LoadDiTModel"), ("vae", "SeedVR2LoadVAEModel")):
        assert api[upscaler["inputs"][role][0]]["class_type"] == kind
    assert sorted(n["class_type"] for n in api.values()) == [
        "LoadImage", "SaveImage", "SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel",
        "SeedVR2VideoUpscaler"]
    assert notes == _old_notes(date, 4)
    # The API format (POST /prompt's handler and run-workflow).
    prompt = old_api_prompt(date)
    assert has_numz_nodes(prompt)
    translated, notes = translate_prompt(prompt, info)
    assert _by_class(translated) == {**expected, "LoadImage": {"image": EXAMPLE_IMAGE},
                                     "SaveImage": {"filename_prefix": "numz/old"}}
    assert translated["4"]["inputs"]["image"] == ["1", 0]
    assert notes == _old_notes(date, 4)


@pytest.mark.parametrize("date", ["2025-08-13", "2025-09-22"])
def test_numz_v2_0_to_2_4_workflows_run_headless(date, tiny_model_dir, inputs, tmp_path,
                                                 capsys, empty_model_cache):
    from PIL import Image

    values = {**OLD_VALUES, "blocks_to_swap": 0}  # no block swap on the CPU
    for name, workflow in (("editor", old_ui_workflow(date, values)),
                           ("api", old_api_prompt(date, values))):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(workflow))
        rc = main(["run-workflow", str(path), "--model-dir", str(tiny_model_dir), "--input-dir",
                   str(inputs), "--output-dir", str(tmp_path / name)])
        assert rc == 0, capsys.readouterr().err
        (saved,) = (tmp_path / name / "numz").glob("*.png")
        with Image.open(saved) as im:
            assert min(im.size) == values["new_resolution"]


# ---------------------------------------------------------------------------------------------
# numz's own example workflows of August to October 2025 (example_workflows/ of its releases
# v2.0-2.4), written here from their facts: the image example of 19 August 2025 (Load Image ->
# SeedVR2 with a SeedVR2BlockSwap and a SeedVR2ExtraArgs node linked in -> Preview Image) and the
# video example (Load Video -> Get Video Components -> SeedVR2 -> Create Video, its fps linked
# from the components -> Save Video). Their BlockSwap nodes swap 16 blocks with preserve_vram
# off: numz's BlockSwap kept the swapped blocks on the CPU by itself.
NUMZ_AUGUST_VALUES = {**OLD_VALUES, "seed": 100, "new_resolution": 16, "batch_size": 1,
                      "blocks_to_swap": 16, "use_non_blocking": False,
                      "offload_io_components": False, "tiled_vae": True, "vae_tile_size": 512,
                      "vae_tile_overlap": 64, "preserve_vram": False, "cache_model": False,
                      "enable_debug": False, "device": "cpu"}  # (theirs: cuda:0)


def numz_august_video_workflow(video: str, values={**NUMZ_AUGUST_VALUES, "batch_size": 5}) -> dict:
    """numz's video example of August 2025, positional widget values as the editor saved them."""
    workflow = old_ui_workflow("2025-08-15", values)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    seedvr2 = nodes[4]
    seedvr2["inputs"][0]["link"] = 10  # images: from Get Video Components
    seedvr2["outputs"][0]["links"] = [18]
    workflow["nodes"] = [n for n in workflow["nodes"] if n["id"] not in (1, 6)] + [
        {"id": 8, "type": "LoadVideo", "mode": 0, "inputs": [],
         "outputs": [{"name": "VIDEO", "type": "VIDEO", "links": [11]}],
         "widgets_values": [video, "image"]},
        {"id": 12, "type": "GetVideoComponents", "mode": 0,
         "inputs": [{"name": "video", "type": "VIDEO", "link": 11}],
         "outputs": [{"name": "images", "type": "IMAGE", "links": [10]},
                     {"name": "audio", "type": "AUDIO", "links": None},
                     {"name": "fps", "type": "FLOAT", "links": [12]}]},
        {"id": 11, "type": "CreateVideo", "mode": 0,
         "inputs": [{"name": "images", "type": "IMAGE", "link": 18},
                    {"name": "audio", "type": "AUDIO", "link": None},
                    {"name": "fps", "type": "FLOAT", "link": 12, "widget": {"name": "fps"}}],
         "outputs": [{"name": "VIDEO", "type": "VIDEO", "links": [7]}], "widgets_values": [30]},
        {"id": 10, "type": "SaveVideo", "mode": 0,
         "inputs": [{"name": "video", "type": "VIDEO", "link": 7}], "outputs": [],
         "widgets_values": ["numz/video", "mp4", "auto"]}]
    workflow["links"] = [link for link in workflow["links"] if link[0] in (3, 4)] + [
        [11, 8, 0, 12, 0, "VIDEO"], [10, 12, 0, 4, 0, "IMAGE"], [12, 12, 2, 11, 2, "FLOAT"],
        [18, 4, 0, 11, 0, "IMAGE"], [7, 11, 0, 10, 0, "VIDEO"]]
    return workflow


def test_numz_blockswap_of_v2_0_to_2_4_offloads_to_the_cpu_as_it_did(tmp_path):
    info = _info(tmp_path)
    for date in ("2025-08-13", "2025-09-16"):
        values = {**NUMZ_AUGUST_VALUES, "preserve_vram": False}
        for api in (ui_to_api(old_ui_workflow(date, values), info),
                    translate_prompt(old_api_prompt(date, values), info)[0]):
            dit = next(n["inputs"] for n in api.values()
                       if n["class_type"] == "SeedVR2LoadDiTModel")
            vae = next(n["inputs"] for n in api.values()
                       if n["class_type"] == "SeedVR2LoadVAEModel")
            assert (dit["blocks_to_swap"], dit["offload_device"]) == (16, "cpu"), date
            assert vae["offload_device"] == "none", date  # preserve_vram off: the VAE stays
    # Swapping the I/O components alone offloads too; no swapping keeps preserve_vram's choice.
    values = {**NUMZ_AUGUST_VALUES, "blocks_to_swap": 0, "offload_io_components": True}
    api = translate_prompt(old_api_prompt("2025-09-16", values), info)[0]
    assert api["7"]["inputs"]["offload_device"] == "cpu"
    values = {**NUMZ_AUGUST_VALUES, "blocks_to_swap": 0}
    api = translate_prompt(old_api_prompt("2025-09-16", values), info)[0]
    assert api["7"]["inputs"]["offload_device"] == "none"


def test_numz_august_2025_examples_run_headless(tiny_model_dir, inputs, tmp_path, capsys,
                                                empty_model_cache):
    from PIL import Image

    from test_workflows import CLIP_FRAMES, probe_video

    from example_workflows import EXAMPLE_VIDEO

    for name, workflow in (("image", old_ui_workflow("2025-08-15", NUMZ_AUGUST_VALUES)),
                           ("video", numz_august_video_workflow(EXAMPLE_VIDEO))):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(workflow))
        rc = main(["run-workflow", str(path), "--model-dir", str(tiny_model_dir), "--input-dir",
                   str(inputs), "--output-dir", str(tmp_path / name), "-q"])
        assert rc == 0, capsys.readouterr().err
        (saved,) = (tmp_path / name / "numz").iterdir()
        if name == "image":
            with Image.open(saved) as im:
                assert min(im.size) == NUMZ_AUGUST_VALUES["new_resolution"]
        else:
            frames, size, _ = probe_video(saved)
            assert frames == CLIP_FRAMES and min(size) == NUMZ_AUGUST_VALUES["new_resolution"]


def _numz_upscaler_values(workflow: dict, **values) -> dict:
    """``workflow`` (numz_ui_workflow's) with the upscaler's widget values changed."""
    upscaler = next(n for n in workflow["nodes"] if n["id"] == 4)
    order = numz_widget_order("SeedVR2VideoUpscaler")
    for name, value in values.items():
        index = order.index(name)
        upscaler["widgets_values"][index + (index > order.index("seed"))] = value
    return workflow


NOT_SMALLER = ("numz's temporal_overlap = 3 is not smaller than batch_size = 1; numz ran it "
               "without overlap, and so does this pack (temporal_overlap = 0)")


def test_numz_temporal_overlap_not_smaller_than_batch_size_runs_without_overlap(
        tiny_model_dir, inputs, tmp_path, empty_model_cache):
    """numz reset such an overlap to 0 with a warning (numz's generation_phases); ours refuses
    it, so the conversion does what numz did, with a note."""
    from PIL import Image

    info = _info(tmp_path)
    notes = []
    workflow = _numz_upscaler_values(numz_ui_workflow(), batch_size=1, temporal_overlap=3,
                                     resolution=16)
    api = ui_to_api(workflow, info, notes.append)
    assert (api["4"]["inputs"]["temporal_overlap"], api["4"]["inputs"]["batch_size"]) == (0, 1)
    assert f"node 4 (SeedVR2VideoUpscaler): {NOT_SMALLER}" in notes
    prompt = numz_api_prompt()
    prompt["4"]["inputs"].update(batch_size=1, temporal_overlap=3)
    translated, notes = translate_prompt(prompt, info)
    assert translated["4"]["inputs"]["temporal_overlap"] == 0
    assert f"node 4 (SeedVR2VideoUpscaler): {NOT_SMALLER}" in notes
    # An overlap smaller than the batch stays, as numz ran it.
    prompt["4"]["inputs"].update(batch_size=5, temporal_overlap=3)
    assert translate_prompt(prompt, info)[0]["4"]["inputs"]["temporal_overlap"] == 3

    host = HeadlessHost(model_dir=tiny_model_dir, input_dir=inputs, output_dir=tmp_path / "out",
                        quiet=True)
    result = run_workflow(workflow, host=host)
    assert f"node 4 (SeedVR2VideoUpscaler): {NOT_SMALLER}" in result.warnings
    (saved,) = result.files
    with Image.open(saved) as im:
        assert min(im.size) == 16


def _with_join_image_with_alpha(mode: int) -> dict:
    """numz's November image examples: Load Image's image and mask joined by the core node
    JoinImageWithAlpha before the upscaler (mode 0), or with that node bypassed (mode 4)."""
    workflow = numz_ui_workflow()
    load = next(n for n in workflow["nodes"] if n["id"] == 1)
    load["outputs"] = [{"name": "IMAGE", "type": "IMAGE", "links": [14]},
                       {"name": "MASK", "type": "MASK", "links": [17]}]
    workflow["nodes"].append({"id": 17, "type": "JoinImageWithAlpha", "mode": mode,
                              "inputs": [{"name": "image", "type": "IMAGE", "link": 14},
                                         {"name": "alpha", "type": "MASK", "link": 17}],
                              "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]}],
                              "widgets_values": []})
    workflow["links"][0] = [1, 17, 0, 4, 0, "IMAGE"]
    workflow["links"] += [[14, 1, 0, 17, 0, "IMAGE"], [17, 1, 1, 17, 1, "MASK"]]
    return workflow


def test_a_numz_workflow_with_a_core_node_this_runner_lacks_is_refused_naming_it(tmp_path):
    info = _info(tmp_path)
    with pytest.raises(WorkflowError) as caught:
        ui_to_api(_with_join_image_with_alpha(0), info)
    assert str(caught.value) == (
        "node 17 (JoinImageWithAlpha): unknown node type 'JoinImageWithAlpha' (not one of our "
        "nodes, nor a core node this runner provides; run it with --server against a ComfyUI "
        "that has it)")
    bypassed = ui_to_api(_with_join_image_with_alpha(4), info)  # passes the image on
    assert bypassed["4"]["inputs"]["image"] == ["1", 0] and "17" not in bypassed


def test_numz_tile_overlap_not_smaller_than_its_tile_converts_to_what_numz_tiling_ran(tmp_path):
    """numz's VAE tiling clamped the overlap to one latent pixel (8 pixels) under the tile;
    ours refuses such an overlap, so the conversion writes what numz ran, with a note."""
    info = _info(tmp_path)
    values = {**OLD_VALUES, "vae_tile_size": 256, "vae_tile_overlap": 256}
    translated, notes = translate_prompt(old_api_prompt("2025-09-22", values), info)
    vae = next(n["inputs"] for n in translated.values()
               if n["class_type"] == "SeedVR2LoadVAEModel")
    assert [vae[f"{stage}_tile_{key}"] for stage in ("encode", "decode")
            for key in ("size", "overlap")] == [256, 248, 256, 248]
    assert notes[-1] == ("node 4 (SeedVR2): numz's vae_tile_overlap = 256 is not smaller than "
                         "vae_tile_size = 256; numz's tiling overlapped 248 pixels, and so does "
                         "this pack")
    workflow = numz_ui_workflow()
    vae_node = next(n for n in workflow["nodes"] if n["id"] == 3)
    order = numz_widget_order("SeedVR2LoadVAEModel")
    vae_node["widgets_values"][order.index("decode_tile_overlap")] = 160
    notes = []
    api = ui_to_api(workflow, info, notes.append)
    size = NUMZ_VALUES["SeedVR2LoadVAEModel"]["decode_tile_size"]
    assert (api["3"]["inputs"]["decode_tile_size"], api["3"]["inputs"]["decode_tile_overlap"]) \
        == (size, size - 8)
    assert (f"node 3 (SeedVR2LoadVAEModel): numz's decode_tile_overlap = 160 is not smaller than "
            f"decode_tile_size = {size}; numz's tiling overlapped {size - 8} pixels, and so does "
            f"this pack") in notes
