"""The pack in the real ComfyUI editor: headless Chromium (Debian's chromium and chromium-driver,
driven by selenium) on the editor served by the test ComfyUI of test_comfyui_server.py.

One browser and one ComfyUI server for the module. The browser comes from
``scripts/comfyui_test_env.sh browser`` (installs it with apt-get when missing); when it cannot be
had the tests fail saying so, unless SEEDVR2_SKIP_BROWSER_TESTS=1 opts out explicitly. No display
and no network are needed. Screenshots of every step are kept in test-artifacts/browser/
(git-ignored; SEEDVR2_TEST_ARTIFACTS moves it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import example_workflows as examples
from conftest import REPO
from test_comfyui_server import NATIVE_VAES, serve_comfyui
from test_comfyui_server import comfyui  # noqa: F401  (the module's ComfyUI server)
from test_workflows import EXAMPLES_DIR, IMAGE_OUT, NAMES


SKIP_ENV = "SEEDVR2_SKIP_BROWSER_TESTS"
ARTIFACTS = Path(os.environ.get("SEEDVR2_TEST_ARTIFACTS") or REPO / "test-artifacts") / "browser"
# 1280 x 900 gives a 1280 x 757 editor canvas: room for the 1280 x 720 view the examples are
# laid out for (examples.VIEW_SIZE).
WINDOW = (1280, 900)
RUN_TIMEOUT = 300
TINY = {"SeedVR2LoadDiTModel": {"model": "dit3b_tiny.safetensors"},
        "SeedVR2LoadVAEModel": {"model": "vae_tiny.safetensors"},
        "SeedVR2VideoUpscaler": {"resolution": 64, "batch_size": 5},
        "SeedVR2UpscaleVideoFile": {"resolution": 64, "batch_size": 5},
        "SeedVR2UpscaleVideo": {"resolution": 64, "batch_size": 5}}

# Loads a workflow the way the editor opens a file, then waits until the pictures and players
# the nodes show have loaded and the node sizes have settled (the editor grows a node to fit
# its preview); returns what the tests check.
LOAD_AND_DESCRIBE = """
const [workflow, done] = arguments;
(async () => {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  if (workflow) await window.app.loadGraphData(workflow);
  let last = "", stable = 0;
  for (let i = 0; i < 100 && stable < 4; i++) {
    await sleep(250);
    window.app.canvas.setDirty(true, true);
    window.app.canvas.draw(true, true);
    const media = [...document.querySelectorAll("video")].every((v) => !v.src || v.readyState >= 1);
    const sizes = JSON.stringify(window.app.graph._nodes.map((n) => [n.pos, n.size]));
    stable = media && sizes === last ? stable + 1 : 0;
    last = sizes;
  }
  done(window.seedvr2Describe());
})().catch((e) => done({error: String(e && e.stack || e)}));
"""

DESCRIBE = """
window.seedvr2Describe = () => {
  const canvas = window.app.canvas;
  const rect = (el) => el ? el.getBoundingClientRect().toJSON() : null;
  const nodes = window.app.graph._nodes.map((n) => ({
    id: n.id, type: n.type, bounding: [...n.getBounding()], computed: [...n.computeSize()],
    registered: !!LiteGraph.registered_node_types[n.type],
    widgets: (n.widgets || []).map((w) => ({
      name: w.name, type: w.type, value: w.value,
      values: Array.isArray(w.options?.values) ? w.options.values : null,
      label: w.options?.getOptionLabel ? w.options.getOptionLabel(w.value) : null,
      min: w.options?.min ?? null, max: w.options?.max ?? null})),
    widgets_values: n.serialize().widgets_values ?? null,
  }));
  return {nodes, scale: canvas.ds.scale, offset: [...canvas.ds.offset],
          canvas: [canvas.canvas.clientWidth, canvas.canvas.clientHeight],
          sidebar: rect(document.querySelector(".side-tool-bar-container")),
          actionbar: rect(document.querySelector(".actionbar"))};
};
"""


def _browser_paths() -> tuple[str, str]:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the browser tests are switched off")
    result = subprocess.run(["bash", str(REPO / "scripts" / "comfyui_test_env.sh"), "browser"],
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        pytest.fail(f"the browser tests need Debian's chromium and chromium-driver, which could "
                    f"not be installed:\n{result.stderr[-3000:]}\nInstall them (apt-get install "
                    f"chromium chromium-driver), or set {SKIP_ENV}=1 to skip these tests.",
                    pytrace=False)
    chromium, driver = result.stdout.strip().splitlines()[-2:]
    return chromium, driver


@pytest.fixture(scope="module")
def browser(comfyui):  # noqa: F811
    with _editor(comfyui) as driver:
        yield driver


@contextlib.contextmanager
def _editor(server):
    """Headless Chromium on the editor ``server`` serves, started and ready."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "--mute-audio"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_script_timeout(120)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    # A new user is greeted with the Templates browser, open over the Run button: this user
    # has seen it (the templates test opens it itself).
    request = urllib.request.Request(server.url + "/settings/Comfy.TutorialCompleted",
                                     data=b"true", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).read()
    try:
        driver.get(server.url)
        deadline = time.monotonic() + 120
        while not driver.execute_script(
                "return !!(window.app && window.app.graph && window.app.canvas && "
                "window.LiteGraph && window.app.extensionManager)"):
            assert time.monotonic() < deadline, "the editor did not start"
            time.sleep(0.5)
        driver.execute_script(DESCRIBE)
        yield driver
    finally:
        driver.quit()


def _close_dialogs(driver):
    from selenium.webdriver.common.keys import Keys

    for _ in range(5):
        if not driver.execute_script("return document.querySelectorAll('[role=dialog]').length"):
            return
        driver.switch_to.active_element.send_keys(Keys.ESCAPE)
        time.sleep(0.5)


def _workflow(name: str) -> dict:
    return json.loads((EXAMPLES_DIR / f"{name}.json").read_text())


def _load(browser, workflow) -> dict:
    _close_dialogs(browser)
    state = browser.execute_async_script(LOAD_AND_DESCRIBE, workflow)
    assert "error" not in state, state.get("error")
    return state


def _screenshot(browser, name: str):
    browser.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def _overlaps(state) -> list:
    nodes = state["nodes"]
    found = []
    for i, a in enumerate(nodes):
        ax, ay, aw, ah = a["bounding"]
        for b in nodes[i + 1:]:
            bx, by, bw, bh = b["bounding"]
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append((f"{a['id']} {a['type']}", f"{b['id']} {b['type']}"))
    return found


def _outside_view(state) -> list:
    """Nodes not wholly in the canvas, or under the side bar or the top bars."""
    scale, (ox, oy) = state["scale"], state["offset"]
    left = state["sidebar"]["right"] if state["sidebar"] else 0
    top = state["actionbar"]["bottom"] if state["actionbar"] else 0
    width, height = state["canvas"]
    outside = []
    for node in state["nodes"]:
        x, y, w, h = node["bounding"]
        box = ((x + ox) * scale, (y + oy) * scale, (x + w + ox) * scale, (y + h + oy) * scale)
        if box[0] < left or box[1] < top or box[2] > width or box[3] > height:
            outside.append((f"{node['id']} {node['type']}", [round(v) for v in box]))
    return outside


# ---------------------------------------------------------------------------------------------


def test_templates_list_only_the_editor_examples_each_loading_with_its_thumbnail(browser):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def open_templates(name=None):
        """The template cards, once the dialog lists every example (or the one named).

        The dialog is opened afresh each time; if it does not show the cards (it can still be
        closing from the last pick), it is closed and opened again."""
        for _ in range(3):
            _close_dialogs(browser)
            browser.execute_script(
                "window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                cards = browser.find_elements(
                    By.CSS_SELECTOR, "[data-testid^='template-workflow-']")
                try:
                    ids = [c.get_attribute("data-testid") for c in cards]
                except StaleElementReferenceException:  # the old dialog's, being removed
                    continue
                if (name is None and len(cards) >= len(NAMES)) or \
                        f"template-workflow-{name}" in ids:
                    return cards
                time.sleep(0.5)
        _screenshot(browser, f"templates_missing_{name}")
        return cards

    try:
        _check_templates(browser, open_templates)
    finally:
        _close_dialogs(browser)


def _check_templates(browser, open_templates):
    cards = open_templates()
    listed = sorted(c.get_attribute("data-testid").removeprefix("template-workflow-")
                    for c in cards)
    assert listed == sorted(NAMES)
    time.sleep(1)  # the thumbnails load
    thumbs = browser.execute_script("""
        return [...document.querySelectorAll("[data-testid^='template-workflow-'] img")].map(
            (img) => [img.closest("[data-testid]").dataset.testid, img.currentSrc || img.src,
                      img.complete, img.naturalWidth]);""")
    _screenshot(browser, "templates")
    for testid, src, complete, width in thumbs:
        name = testid.removeprefix("template-workflow-")
        # The editor fetches <name>.jpg into a blob; without one it shows its default picture.
        assert complete and width == examples.THUMB_WIDTH and "default-template" not in src, \
            (name, src, width)
    assert {t[0] for t in thumbs} == {f"template-workflow-{n}" for n in NAMES}
    # Each one opens as the workflow it is (an API-format file opens an empty canvas).
    for name in NAMES:
        cards = {c.get_attribute("data-testid"): c for c in open_templates(name)}
        card = cards.get(f"template-workflow-{name}")
        assert card is not None, (name, sorted(cards))
        card.click()
        deadline = time.monotonic() + 30
        expected = sorted(n["type"] for n in _workflow(name)["nodes"])
        while sorted(browser.execute_script(
                "return window.app.graph._nodes.map((n) => n.type)")) != expected:
            assert time.monotonic() < deadline, f"template {name} did not open"
            time.sleep(0.5)
        _close_dialogs(browser)


@pytest.mark.parametrize("name", NAMES)
def test_example_loads_complete_valid_uncluttered_and_in_view(browser, name):
    workflow = _workflow(name)
    state = _load(browser, workflow)
    _screenshot(browser, f"example_{name}")
    assert [n["type"] for n in state["nodes"] if not n["registered"]] == []
    saved = {n["id"]: n["widgets_values"] for n in workflow["nodes"]}
    saved_size = {n["id"]: n["size"] for n in workflow["nodes"]}
    for node in state["nodes"]:
        if node["type"] not in examples.PREVIEW_ROOM:
            # Saved as tall as the editor makes it for its sockets and widgets, no taller.
            assert saved_size[node["id"]][1] == node["computed"][1], node["type"]
        # The editor keeps every saved value (none dropped, shifted or replaced).
        assert node["widgets_values"] == saved[node["id"]], node["type"]
        for widget in node["widgets"]:
            where = (node["type"], widget["name"], widget["value"])
            if widget["type"] == "combo" and widget["values"] is not None:
                assert widget["value"] in widget["values"], where
            if widget["type"] == "number":
                assert widget["min"] is None or widget["value"] >= widget["min"], where
                assert widget["max"] is None or widget["value"] <= widget["max"], where
    assert state["canvas"][0] >= examples.VIEW_SIZE[0] and \
        state["canvas"][1] >= examples.VIEW_SIZE[1]
    assert _overlaps(state) == []
    assert _outside_view(state) == []


def test_new_nodes_start_with_a_fixed_seed_and_models_the_user_has(browser):
    state = browser.execute_script("""
        window.app.graph.clear();
        for (const type of ["SeedVR2VideoUpscaler", "SeedVR2UpscaleVideoFile",
                            "SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel"]) {
          window.app.graph.add(LiteGraph.createNode(type));
        }
        return window.seedvr2Describe();""")
    widgets = {(n["type"], w["name"]): w for n in state["nodes"] for w in n["widgets"]}
    for upscaler in ("SeedVR2VideoUpscaler", "SeedVR2UpscaleVideoFile"):
        assert widgets[(upscaler, "control_after_generate")]["value"] == "fixed"
    dit, vae = widgets[("SeedVR2LoadDiTModel", "model")], widgets[("SeedVR2LoadVAEModel", "model")]
    assert dit["value"] == "dit3b_tiny.safetensors" and dit["label"] == dit["value"]
    assert dit["values"][0] == "dit3b_tiny.safetensors"
    assert "seedvr2_ema_3b_fp16.safetensors" in dit["values"]
    # The VAE folders hold vae_extra (extra_model_paths.yaml) and vae_tiny, ComfyUI's vae/ two
    # SeedVR2 VAEs (NATIVE_VAES): all before the released file still to download, which is
    # labelled as one.
    assert vae["values"] == [*sorted([*NATIVE_VAES, "vae_extra.safetensors",
                                      "vae_tiny.safetensors"]), "ema_vae_fp16.safetensors"]
    assert vae["value"] == vae["values"][0]
    label = browser.execute_script("""
        const node = window.app.graph._nodes.find((n) => n.type === "SeedVR2LoadVAEModel");
        const widget = node.widgets.find((w) => w.name === "model");
        return widget.options.getOptionLabel("ema_vae_fp16.safetensors");""")
    assert label == "ema_vae_fp16.safetensors  (download, about 501 MB)"


def _tiny(browser, workflow: dict) -> dict:
    """The workflow with the tiny models and sizes in its widgets, as a user would set them."""
    workflow = json.loads(json.dumps(workflow))
    _load(browser, workflow)
    browser.execute_script("""
        const tiny = arguments[0];
        for (const node of window.app.graph._nodes) {
          for (const [name, value] of Object.entries(tiny[node.type] || {})) {
            node.widgets.find((w) => w.name === name).value = value;
          }
        }""", TINY)
    return workflow


def _history(comfyui) -> dict:  # noqa: F811
    with urllib.request.urlopen(comfyui.url + "/history", timeout=30) as reply:
        return json.loads(reply.read())


def _run(browser, comfyui) -> set:  # noqa: F811
    """Click Run; the ids of the prompts queued before."""
    from selenium.webdriver.common.by import By

    before = set(_history(comfyui))
    _close_dialogs(browser)
    run = next(b for b in browser.find_elements(By.CSS_SELECTOR, "button")
               if b.text.strip() == "Run")
    try:
        run.click()
    except Exception:
        _screenshot(browser, "run_button_covered")
        raise
    return before


def _wait_for(browser, script: str, what: str, comfyui, before: set):  # noqa: F811
    """Poll ``script`` until it returns something. Fails at once when the prompt was rejected
    or its run failed, and soon after a successful run that did not show it."""
    deadline, shown_by = time.monotonic() + RUN_TIMEOUT, None
    while True:
        found = browser.execute_script(script)
        if found:
            return found
        rejected = browser.execute_script(
            "const e = window.app.lastNodeErrors;"
            "return e && Object.keys(e).length ? JSON.stringify(e) : null;")
        if rejected:
            _screenshot(browser, f"rejected_{what.replace(' ', '_')}")
            pytest.fail(f"the editor's prompt was rejected: {rejected}")
        for prompt_id, entry in _history(comfyui).items():
            if prompt_id in before:
                continue
            status = entry["status"].get("status_str")
            if status == "error":
                _screenshot(browser, f"failed_{what.replace(' ', '_')}")
                pytest.fail(f"the run failed: {entry['status'].get('messages')}")
            if status == "success" and shown_by is None:
                shown_by = time.monotonic() + 30  # the editor draws results as they arrive
        if time.monotonic() > (shown_by or deadline):
            _screenshot(browser, f"missing_{what.replace(' ', '_')}")
            pytest.fail(f"{what} did not appear on the node "
                        f"({'the run succeeded' if shown_by else f'no result in {RUN_TIMEOUT} s'})"
                        f":\n{comfyui.log_tail()}")
        time.sleep(1)


def _saved_image_size(browser, comfyui, before) -> list:
    """(width, height) of the picture the SaveImage node shows once the run has saved it."""
    return _wait_for(browser, """
        const node = window.app.graph._nodes.find((n) => n.type === "SaveImage");
        const img = node && node.imgs && node.imgs[0];
        return img && img.complete && img.naturalWidth ? [img.naturalWidth, img.naturalHeight]
                                                       : null;""", "the saved image", comfyui,
                     before)


def test_image_example_runs_from_the_run_button_and_shows_its_result(browser, comfyui):  # noqa: F811
    _tiny(browser, _workflow("image_upscale"))
    before = _run(browser, comfyui)
    size = _saved_image_size(browser, comfyui, before)
    assert tuple(size) == IMAGE_OUT
    state = _load(browser, None)  # the node grown with its picture
    _screenshot(browser, "run_image_upscale")
    assert _overlaps(state) == []


def test_upscale_video_file_shows_the_finished_video_on_the_node(browser, comfyui):  # noqa: F811
    _tiny(browser, _workflow("video_file_streaming"))
    before = _run(browser, comfyui)
    src = _wait_for(browser, """
        const node = window.app.graph._nodes.find((n) => n.type === "SeedVR2UpscaleVideoFile");
        const outputs = window.app.nodeOutputs?.[String(node.id)];
        const shown = [...document.querySelectorAll("video")].map((v) => v.currentSrc || v.src)
          .filter((s) => s.includes("type=output") && s.includes("file_"));
        return outputs && shown.length ? shown[0] : null;""", "the upscaled video", comfyui,
                    before)
    assert "subfolder=SeedVR2" in src and ".mp4" in src
    state = _load(browser, None)
    _screenshot(browser, "run_video_file_streaming")
    assert _overlaps(state) == []


def test_numz_workflow_opens_with_every_value_in_its_place_and_runs(browser, comfyui):  # noqa: F811
    """A workflow saved with the numz pack (v2.5.24's layout, written by test_numz from numz's
    input lists) opens with each value on our input of the same meaning, and runs."""
    from test_numz import NUMZ_VALUES, expected_inputs, numz_ui_workflow

    info = comfyui.client.object_info()
    state = _load(browser, numz_ui_workflow(compile_args=True))
    _screenshot(browser, "numz_workflow")
    nodes = {n["id"]: n for n in state["nodes"]}
    assert [n["type"] for n in state["nodes"] if not n["registered"]] == []
    for node_id, kind in ((2, "SeedVR2LoadDiTModel"), (3, "SeedVR2LoadVAEModel"),
                          (5, "SeedVR2TorchCompileSettings"), (4, "SeedVR2VideoUpscaler")):
        widgets = {w["name"]: w["value"] for w in nodes[node_id]["widgets"]
                   if w["name"] != "control_after_generate"}
        assert widgets == expected_inputs(kind, info), kind
    upscaler = {w["name"]: w["value"] for w in nodes[4]["widgets"]}
    assert upscaler["seed"] == NUMZ_VALUES["SeedVR2VideoUpscaler"]["seed"]
    assert upscaler["control_after_generate"] == "fixed"
    # The links follow their inputs to our slots (numz's loader has the compile input first).
    links = browser.execute_script("""
        const graph = window.app.graph;
        const origin = (node, name) => {
          const input = graph.getNodeById(node).inputs.find((i) => i.name === name);
          const link = graph.links.get ? graph.links.get(input.link) : graph.links[input.link];
          return link ? [link.origin_id, link.origin_slot] : null;
        };
        return [origin(2, "torch_compile_args"), origin(4, "image"), origin(4, "dit"),
                origin(4, "vae")];""")
    assert links == [[5, 0], [1, 0], [2, 0], [3, 0]]

    # What has no place here is told in a notice (it would cover the Run button: closed).
    notices = browser.execute_script("""
        const texts = [...document.querySelectorAll(".p-toast-message")].map((t) => t.innerText);
        for (const button of document.querySelectorAll(".p-toast-close-button")) button.click();
        return texts;""")
    assert any("SeedVR2: opened a numz workflow" in t and "enable_debug = True" in t
               for t in notices), notices

    _load(browser, numz_ui_workflow())  # torch.compile left out: no compiler toolchain here
    browser.execute_script("""
        for (const button of document.querySelectorAll(".p-toast-close-button")) button.click();""")
    time.sleep(1)
    before = _run(browser, comfyui)
    size = _saved_image_size(browser, comfyui, before)
    assert tuple(size) == IMAGE_OUT
    prompt = next(entry["prompt"][2] for prompt_id, entry in _history(comfyui).items()
                  if prompt_id not in before)
    assert prompt["2"]["inputs"]["attention_backend"] == "sdpa"


def _js_set(name: str) -> list:
    import re

    source = (REPO / "web" / "seedvr2.js").read_text()
    match = re.search(rf"const {name} = new Set\(\[(.*?)\]\);", source, re.DOTALL)
    assert match, f"web/seedvr2.js has no {name}"
    return re.findall(r'"(\w+)"', match[1])


def test_the_editor_extension_knows_our_exact_node_ids_and_numz_s():
    """The extension touches only these IDs (not every SeedVR2* node: ComfyUI's native
    SeedVR2Preprocess, SeedVR2Conditioning ... are not ours); its lists are the library's."""
    from seedvr2.workflow.nodes import build_nodes
    from seedvr2.workflow.numz import NUMZ_NODES

    assert _js_set("OUR_NODES") == [n.id for n in build_nodes()]
    assert _js_set("NUMZ_NODES") == list(NUMZ_NODES)
    source = (REPO / "web" / "seedvr2.js").read_text()
    assert 'startsWith("SeedVR2")' not in source


# -- Today's editor (comfyui-frontend-package, scripts/comfyui_test_env.sh frontend) --------------

# ComfyUI's own SeedVR2 nodes (comfy_extras, newer than the test ComfyUI: missing there, which
# the editor keeps as they were saved).
NATIVE_SEEDVR2 = ("SeedVR2Preprocess", "SeedVR2Conditioning", "SeedVR2TemporalChunk",
                  "SeedVR2TemporalMerge", "SeedVR2PostProcessing")

# Loads a workflow while recording every request; returns the requests to the pack's routes and
# the graph's nodes as the editor saves them.
LOAD_RECORDING_REQUESTS = """
const [workflow, done] = arguments;
(async () => {
  const requests = [], original = window.fetch;
  window.fetch = (input, init) => {
    requests.push(String(input?.url ?? input));
    return original(input, init);
  };
  try {
    await window.app.loadGraphData(workflow);
  } finally {
    window.fetch = original;
  }
  const nodes = window.app.graph.serialize().nodes.map(
    (n) => [n.id, n.type, n.widgets_values ?? null]);
  done({requests: requests.filter((url) => url.includes("/seedvr2/")), nodes});
})().catch((e) => done({error: String(e && e.stack || e)}));
"""


@pytest.fixture(scope="module")
def current_editor(tiny_model_dir, tmp_path_factory):
    """A second test ComfyUI serving today's editor (--front-end-root), and a browser on it."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "comfyui_test_env.sh"), "frontend"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    static = result.stdout.strip().splitlines()[-1]
    with serve_comfyui(tiny_model_dir, tmp_path_factory.mktemp("comfyui_current_editor"),
                       ["--front-end-root", static]) as server, _editor(server) as driver:
        yield driver, server


def _native_seedvr2_workflow() -> dict:
    nodes = [{"id": i, "type": kind, "pos": [i * 320, 100], "size": [300, 120], "flags": {},
              "order": i, "mode": 0, "inputs": [], "outputs": [], "properties": {},
              "widgets_values": [i, 0.5, "keep"]}
             for i, kind in enumerate(NATIVE_SEEDVR2, start=1)]
    return {"last_node_id": len(nodes), "last_link_id": 0, "nodes": nodes, "links": [],
            "groups": [], "config": {}, "extra": {}, "version": 0.4}


def test_current_editor_leaves_a_native_seedvr2_workflow_alone(current_editor):
    """ComfyUI's native SeedVR2 nodes are not ours: the extension sends nothing to the pack's
    route (whose JSON round trip would have turned non-finite numbers into null) and the graph
    holds what was loaded."""
    browser, _ = current_editor
    state = browser.execute_async_script(LOAD_RECORDING_REQUESTS, _native_seedvr2_workflow())
    _close_dialogs(browser)  # the missing nodes' notice
    _screenshot(browser, "current_editor_native_seedvr2")
    assert "error" not in state, state.get("error")
    assert state["requests"] == []
    expected = [[i, kind, [i, 0.5, "keep"]] for i, kind in enumerate(NATIVE_SEEDVR2, start=1)]
    assert sorted(state["nodes"]) == expected


def _numz_subgraph_workflow() -> dict:
    """An instance of a subgraph whose only node is numz's VAE loader (numz v2.5.24's layout)."""
    from test_numz import NUMZ_VALUES, _numz_node

    inner = _numz_node(1, "SeedVR2LoadVAEModel", NUMZ_VALUES["SeedVR2LoadVAEModel"], {}, [],
                       names=True)
    subgraph_id = "7d3a2b1c-0000-4000-8000-000000000001"
    subgraph = {"id": subgraph_id, "version": 1, "revision": 0, "name": "numz VAE",
                "state": {"lastGroupId": 0, "lastNodeId": 1, "lastLinkId": 0,
                          "lastRerouteId": 0},
                "config": {}, "inputNode": {"id": -10, "bounding": [0, 0, 120, 60]},
                "outputNode": {"id": -20, "bounding": [900, 0, 120, 60]},
                "inputs": [], "outputs": [], "widgets": [], "nodes": [inner], "groups": [],
                "links": [], "extra": {}}
    instance = {"id": 1, "type": subgraph_id, "pos": [100, 100], "size": [300, 80],
                "flags": {}, "order": 0, "mode": 0, "inputs": [], "outputs": [],
                "properties": {}, "widgets_values": []}
    return {"id": "7d3a2b1c-0000-4000-8000-000000000002", "revision": 0, "last_node_id": 1,
            "last_link_id": 0, "nodes": [instance], "links": [], "groups": [], "config": {},
            "extra": {}, "version": 0.4, "definitions": {"subgraphs": [subgraph]}}


def test_current_editor_rewrites_a_numz_node_inside_a_subgraph(current_editor):
    """Today's editor builds a workflow's subgraphs before beforeConfigureGraph: the numz
    rewrite, made there, still reaches the node inside the subgraph."""
    from test_numz import expected_inputs

    browser, server = current_editor
    _load(browser, _numz_subgraph_workflow())
    _close_dialogs(browser)
    widgets = browser.execute_script("""
        const [subgraph] = [...window.app.graph.subgraphs.values()];
        const node = subgraph.nodes[0];
        return Object.fromEntries(node.widgets.map((w) => [w.name, w.value]));""")
    assert widgets == expected_inputs("SeedVR2LoadVAEModel", server.client.object_info())
