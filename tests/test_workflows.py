"""Example workflows and headless execution (``seedvr2 run-workflow``), in this process."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import example_workflows as examples
from conftest import REPO

from seedvr2.cli import main
from seedvr2.workflow.convert import ui_to_api
from seedvr2.workflow.errors import WorkflowError
from seedvr2.workflow.host import HeadlessHost
from seedvr2.workflow.run import apply_sets, builtin_object_info, run_workflow, to_api

EXAMPLES_DIR = REPO / "example_workflows"
API_DIR = EXAMPLES_DIR / examples.API_FOLDER  # the API twins
NAMES = [e.name for e in examples.EXAMPLES]
CLIP_FRAMES, CLIP_SIZE, IMAGE_SIZE = 9, (64, 48), (56, 40)  # (width, height)
VIDEO_OUT, IMAGE_OUT = (86, 64), (90, 64)  # short edge 64 (resolution), even sizes


def make_inputs(folder: Path) -> Path:
    """The files the examples load: a 9-frame clip with AAC audio, and an image."""
    import av
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE[1], IMAGE_SIZE[0], 3), dtype=np.uint8)).save(
        folder / examples.EXAMPLE_IMAGE)
    fps, rate = Fraction(24), 48000
    with av.open(str(folder / examples.EXAMPLE_VIDEO), "w") as out:
        video = out.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = *CLIP_SIZE, "yuv420p"
        audio = out.add_stream("aac", rate=rate, layout="mono")
        for i in range(CLIP_FRAMES):
            pixels = np.zeros((CLIP_SIZE[1], CLIP_SIZE[0], 3), np.uint8)
            pixels[..., 0], pixels[:, 4 * i % CLIP_SIZE[0], 1] = 20 * i, 255
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts, frame.time_base = i, 1 / fps
            out.mux(video.encode(frame))
        samples = (0.3 * np.sin(np.arange(int(CLIP_FRAMES / fps * rate)) / 20)).astype(np.float32)
        for start in range(0, len(samples), 1024):
            chunk = av.AudioFrame.from_ndarray(samples[None, start:start + 1024], format="flt",
                                               layout="mono")
            chunk.sample_rate, chunk.pts, chunk.time_base = rate, start, Fraction(1, rate)
            out.mux(audio.encode(chunk))
        out.mux(video.encode(None))
        out.mux(audio.encode(None))
    return folder


def probe_video(path: Path) -> tuple:
    """(frames, (width, height), has audio) of a written video."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(stream))
        return frames, (stream.width, stream.height), bool(container.streams.audio)


def tiny_sets(prompt: dict) -> list[str]:
    """--set overrides that run an example with the tiny models at 64 px on the CPU."""
    sets = []
    for node_id, node in prompt.items():
        kind = node["class_type"]
        if kind == "SeedVR2LoadDiTModel":
            sets.append(f"{node_id}.model=dit3b_tiny.safetensors")
            if node["inputs"].get("blocks_to_swap"):
                sets.append(f"{node_id}.blocks_to_swap=2")  # the tiny DiT has 4 blocks
        elif kind == "SeedVR2LoadVAEModel":
            sets.append(f"{node_id}.model=vae_tiny.safetensors")
        elif kind in ("SeedVR2VideoUpscaler", "SeedVR2UpscaleVideoFile", "SeedVR2UpscaleVideo"):
            sets += [f"{node_id}.resolution=64", f"{node_id}.batch_size=5"]
    return sets


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return make_inputs(tmp_path_factory.mktemp("input"))


def _host(tiny_model_dir, inputs, tmp_path) -> HeadlessHost:
    return HeadlessHost(model_dir=tiny_model_dir, input_dir=inputs, output_dir=tmp_path / "out",
                        quiet=True)


def _api(name: str) -> dict:
    return json.loads((API_DIR / f"{name}.json").read_text())


# ---------------------------------------------------------------------------------------------
# The examples


def test_example_files_are_what_the_example_module_writes():
    """Regenerate with: .venv/bin/python scripts/gen_examples.py"""
    written = examples.files()
    on_disk = {p.relative_to(EXAMPLES_DIR).as_posix(): p.read_text()
               for p in EXAMPLES_DIR.rglob("*.json")}
    assert sorted(on_disk) == sorted(written)
    for name, text in written.items():
        assert on_disk[name] == text, \
            f"{name} is stale: run .venv/bin/python scripts/gen_examples.py"


@pytest.mark.parametrize("name", NAMES)
def test_every_template_has_a_thumbnail_of_its_current_workflow(name):
    """<name>.jpg beside each template: the result of running it (gen_examples --thumbnails), made
    from the workflow as it is now (the stamp in the JPEG comment: its API prompt's digest)."""
    from PIL import Image

    example = next(e for e in examples.EXAMPLES if e.name == name)
    with Image.open(EXAMPLES_DIR / f"{name}.jpg") as thumbnail:
        assert thumbnail.format == "JPEG" and thumbnail.width == examples.THUMB_WIDTH
        stamp = thumbnail.info.get("comment", b"").decode()
    assert stamp == examples.thumbnail_stamp(example), (
        f"{name}.jpg pictures an older {name}.json: run .venv/bin/python scripts/gen_examples.py "
        f"--thumbnails")


def test_only_editor_format_files_are_templates():
    """ComfyUI lists every example_workflows/*.json as a template: API twins live in api/."""
    for path in EXAMPLES_DIR.glob("*.json"):
        workflow = json.loads(path.read_text())
        assert "nodes" in workflow and "version" in workflow, path.name
    assert sorted(p.stem for p in EXAMPLES_DIR.glob("*.json")) == sorted(NAMES)
    assert sorted(p.stem for p in API_DIR.glob("*.json")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_ui_example_converts_to_its_api_twin(name, tmp_path):
    ui = json.loads((EXAMPLES_DIR / f"{name}.json").read_text())
    info = builtin_object_info(HeadlessHost(model_dir=tmp_path))
    assert ui_to_api(ui, info) == _api(name)


@pytest.mark.parametrize("name", NAMES)
def test_every_loader_declares_its_model_download(name):
    """The editor's missing-models dialog offers a download for each model a node's
    properties.models declares (name, URL, models/ folder): every model a loader of ours names
    is declared there, with the registry's URL."""
    from seedvr2.loading.registry import KNOWN_FILES

    api = _api(name)
    loaders = [n for n in json.loads((EXAMPLES_DIR / f"{name}.json").read_text())["nodes"]
               if "model" in api[str(n["id"])]["inputs"]]
    assert {KNOWN_FILES[api[str(n["id"])]["inputs"]["model"]].kind for n in loaders} == \
        {"dit", "vae"}
    for node in loaders:
        model = api[str(node["id"])]["inputs"]["model"]
        known = KNOWN_FILES[model]
        assert node["properties"]["models"] == [{
            "name": model, "url": f"https://huggingface.co/{known.repo}/resolve/main/{model}",
            "directory": "SEEDVR2"}], (name, node["type"])


def test_examples_use_only_core_nodes_for_loading_and_saving():
    ours = {"SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel", "SeedVR2VideoUpscaler",
            "SeedVR2UpscaleVideoFile", "SeedVR2UpscaleVideo", "SeedVR2TorchCompileSettings"}
    core = {"LoadImage", "SaveImage", "PreviewImage", "LoadVideo", "SaveVideo", "CreateVideo",
            "GetVideoComponents"}
    for name in NAMES:
        assert {n["class_type"] for n in _api(name).values()} <= ours | core, name


@pytest.mark.parametrize("name", NAMES)
def test_every_ui_example_runs_in_process(name, tiny_model_dir, inputs, tmp_path):
    from PIL import Image

    prompt = _api(name)
    result = run_workflow(EXAMPLES_DIR / f"{name}.json", tiny_sets(prompt),
                          host=_host(tiny_model_dir, inputs, tmp_path))
    (saved,) = result.files
    if name == "image_upscale":
        assert saved.relative_to(tmp_path / "out") == Path("SeedVR2/image_00001_.png")
        with Image.open(saved) as im:
            assert im.size == IMAGE_OUT
    else:
        assert saved.suffix == ".mp4"
        assert probe_video(saved) == (CLIP_FRAMES, VIDEO_OUT, True)


# ---------------------------------------------------------------------------------------------
# run-workflow: exit status and messages


def _cli(tmp_path, tiny_model_dir, inputs, workflow, *sets) -> int:
    args = ["run-workflow", str(workflow), "--model-dir", str(tiny_model_dir), "--input-dir",
            str(inputs), "--output-dir", str(tmp_path / "out"), "-q"]
    return main(args + [a for s in sets for a in ("--set", s)])


def _tiny_image_sets():
    return tiny_sets(_api("image_upscale"))


@pytest.mark.parametrize("sets, message", [
    (["2.model=missing.safetensors"],
     "error: node 2 (SeedVR2LoadDiTModel): model = 'missing.safetensors': not one of the choices "
     "(dit3b_tiny.safetensors, seedvr2_ema_3b_fp16.safetensors, "),
    (["4.batch_size=4"],
     "error: node 4 (SeedVR2VideoUpscaler): batch_size = 4: must be 4n+1 (1, 5, 9, 13, 17, 21, "
     "...); nearest valid values: 1 or 5\n"),
    (["4.resolution=\"big\""],
     "error: node 4 (SeedVR2VideoUpscaler): resolution = 'big': expected int\n"),
    (["4.resolution=8"],
     "error: node 4 (SeedVR2VideoUpscaler): resolution = 8: below the minimum 16\n"),
    (["4.image=\"photo.png\""],
     "error: node 4 (SeedVR2VideoUpscaler): input 'image' takes IMAGE and must be linked to "
     "another node's output, not given the value 'photo.png'\n"),
    (["4.vae=[\"1\", 0]"],
     "error: node 4 (SeedVR2VideoUpscaler): input 'vae' takes SEEDVR2_VAE but is linked to "
     "LoadImage output 0 (IMAGE)\n"),
    (["9.seed=1"], "error: --set 9: no node with this id, title or type (nodes: 1 LoadImage, "),
    (["SeedVR2VideoUpscaler.sead=1"],
     "error: --set SeedVR2VideoUpscaler.sead=1: node 4 (SeedVR2VideoUpscaler) has no input "
     "'sead' (inputs: image, dit, vae, devices, "),
])
def test_bad_input_exits_non_zero_with_the_nodes_message(sets, message, tiny_model_dir, inputs,
                                                         tmp_path, capsys):
    rc = _cli(tmp_path, tiny_model_dir, inputs, API_DIR / "image_upscale.json",
              *_tiny_image_sets(), *sets)
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith(message) if not message.endswith("\n") else err.endswith(message)


def test_registered_model_not_downloaded_names_the_download(tiny_model_dir, inputs, tmp_path,
                                                            capsys, monkeypatch):
    """A registered file missing from the folder is downloaded; offline, the error says where
    to get it and where to put it."""
    from seedvr2.loading import registry

    monkeypatch.setattr(registry, "hub_unreachable", lambda: "offline")
    sets = [s for s in _tiny_image_sets() if not s.startswith("2.model")]
    rc = _cli(tmp_path, tiny_model_dir, inputs, API_DIR / "image_upscale.json", *sets)
    assert rc == 1
    assert capsys.readouterr().err == (
        f"error: node 2 (SeedVR2LoadDiTModel): A model file is missing from the model folder "
        f"{tiny_model_dir}: DiT seedvr2_ema_3b_fp16.safetensors (about 6.8 GB) from "
        f"https://huggingface.co/numz/SeedVR2_comfyUI/resolve/main/seedvr2_ema_3b_fp16.safetensors. "
        f"The Hugging Face hub cannot be reached (offline), so nothing was downloaded. Download it "
        f"into {tiny_model_dir} (or choose another folder with model_dir=FOLDER)\n")


def test_unknown_node_type_and_malformed_json(tiny_model_dir, inputs, tmp_path, capsys):
    prompt = _api("image_upscale")
    prompt["8"] = {"class_type": "FancyUpscaler", "inputs": {}}
    bad = tmp_path / "unknown.json"
    bad.write_text(json.dumps(prompt))
    assert _cli(tmp_path, tiny_model_dir, inputs, bad) == 1
    assert capsys.readouterr().err.startswith(
        "error: node 8 (FancyUpscaler): unknown node type 'FancyUpscaler'; this runner has "
        "CreateVideo, GetVideoComponents, LoadImage, ")
    broken = tmp_path / "broken.json"
    broken.write_text('{"1": {"class_type": "LoadImage",, }')
    assert _cli(tmp_path, tiny_model_dir, inputs, broken) == 1
    assert capsys.readouterr().err == (f"error: {broken}: not valid JSON: Expecting property name "
                                       f"enclosed in double quotes at line 1 column 34\n")
    ui = json.loads((EXAMPLES_DIR / "image_upscale.json").read_text())
    ui["nodes"][0]["type"] = "FancyLoader"
    with pytest.raises(WorkflowError, match=r"^node 1 \(FancyLoader\): unknown node type "
                                            r"'FancyLoader' \(not one of our nodes"):
        to_api(ui, builtin_object_info(HeadlessHost(model_dir=tmp_path)))


# ---------------------------------------------------------------------------------------------
# UI -> API conversion details


def _info(tmp_path):
    return builtin_object_info(HeadlessHost(model_dir=tmp_path))


def _upscaler_ui(tmp_path, widgets_values):
    ui = json.loads((EXAMPLES_DIR / "image_upscale.json").read_text())
    node = next(n for n in ui["nodes"] if n["type"] == "SeedVR2VideoUpscaler")
    node["widgets_values"] = widgets_values
    return ui


def test_seed_control_value_is_skipped_with_or_without_it(tmp_path):
    node = next(n for n in json.loads((EXAMPLES_DIR / "image_upscale.json").read_text())["nodes"]
                if n["type"] == "SeedVR2VideoUpscaler")
    values = node["widgets_values"]
    assert values[2:4] == [42, "fixed"]  # devices, offload_device, seed, control after generate
    without = values[:3] + values[4:]
    for widgets in (values, without, values[:3] + ["randomize"] + values[4:]):
        api = ui_to_api(_upscaler_ui(tmp_path, widgets), _info(tmp_path))
        assert api["4"]["inputs"]["seed"] == 42
        assert api["4"]["inputs"]["resolution"] == 1080
    widgets = len(values) - 1  # every value is a widget's but the control choice
    with pytest.raises(WorkflowError, match=rf"^node 4 \(SeedVR2VideoUpscaler\): {widgets + 2} "
                                            rf"widget values for the {widgets} widgets"):
        ui_to_api(_upscaler_ui(tmp_path, values + ["extra"]), _info(tmp_path))


def test_frontend_only_nodes_are_resolved(tmp_path):
    ui = json.loads((EXAMPLES_DIR / "image_upscale.json").read_text())
    link = next(l for l in ui["links"] if l[1] == 1)  # LoadImage -> upscaler
    # A Reroute in between, a PrimitiveNode feeding seed, a note, a muted preview.
    ui["nodes"].append({"id": 20, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*",
                        "link": 90}], "outputs": [{"name": "", "type": "IMAGE", "links": [link[0]]}]})
    ui["links"].append([90, 1, 0, 20, 0, "IMAGE"])
    link[1], link[2] = 20, 0
    ui["nodes"].append({"id": 21, "type": "PrimitiveNode", "mode": 0, "outputs": [
        {"name": "INT", "type": "INT", "links": [91]}], "widgets_values": [1234, "fixed"]})
    upscaler = next(n for n in ui["nodes"] if n["id"] == 4)
    upscaler["inputs"].append({"name": "seed", "type": "INT", "widget": {"name": "seed"},
                               "link": 91})
    ui["links"].append([91, 21, 0, 4, len(upscaler["inputs"]) - 1, "INT"])
    ui["nodes"].append({"id": 22, "type": "Note", "mode": 0, "widgets_values": ["hello"]})
    ui["nodes"].append({"id": 23, "type": "PreviewImage", "mode": 2, "inputs": [
        {"name": "images", "type": "IMAGE", "link": None}]})
    api = ui_to_api(ui, _info(tmp_path))
    assert sorted(api) == ["1", "2", "3", "4", "5"]
    assert api["4"]["inputs"]["image"] == ["1", 0]
    assert api["4"]["inputs"]["seed"] == 1234


def test_set_by_title_and_values_as_json(tmp_path):
    prompt = _api("image_upscale")
    info = _info(tmp_path)
    out = apply_sets(prompt, ["SeedVR2 Video Upscaler.resolution=720", "5.filename_prefix=x/y",
                              "4.color_correction=lab", "2.cache_model=true"], info)
    assert out["4"]["inputs"]["resolution"] == 720 and out["4"]["inputs"]["color_correction"] == "lab"
    assert out["5"]["inputs"]["filename_prefix"] == "x/y" and out["2"]["inputs"]["cache_model"] is True
    assert prompt["4"]["inputs"]["resolution"] == 1080  # the input prompt is left alone
    with pytest.raises(WorkflowError, match="expected NODE.INPUT=VALUE"):
        apply_sets(prompt, ["resolution=720"], info)


def test_options_added_after_the_first_release_are_optional():
    """A workflow saved before an option existed must still validate: later options are
    optional inputs with their defaults."""
    from seedvr2.workflow.nodes import FIRST_RELEASE_OPTIONS, _upscaler_inputs, pipeline_options

    later = {o.name for o in pipeline_options()} - FIRST_RELEASE_OPTIONS
    assert "dist_timeout" in later
    for writes_file in (False, True):
        inputs = {i.name: i for i in _upscaler_inputs(writes_file=writes_file)}
        assert all(inputs[name].optional for name in later & inputs.keys())
        assert not inputs["batch_size"].optional
    assert "resume" in later


# ---------------------------------------------------------------------------------------------
# --server: uploads (a fake server in test_hostile_inputs.py, the real one in
# test_comfyui_server.py)


def test_uploads_only_local_files_the_server_lacks(tmp_path):
    from seedvr2.workflow.server import upload_inputs

    (tmp_path / "mine.png").write_bytes(b"png")
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "mine.mp4").write_bytes(b"mp4")
    info = {"LoadImage": {"input": {"required": {"image": [["theirs.png"], {"image_upload": True}]}}},
            "LoadVideo": {"input": {"required": {"file": ["COMBO", {"options": ["theirs.mp4"],
                                                                   "video_upload": True}]}}}}
    prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": "mine.png"}},
              "2": {"class_type": "LoadImage", "inputs": {"image": "theirs.png"}},
              "3": {"class_type": "LoadVideo", "inputs": {"file": "clips/mine.mp4"}},
              "4": {"class_type": "SeedVR2UpscaleVideoFile", "inputs": {"video_path": "mine.png"}},
              "5": {"class_type": "LoadImage", "inputs": {"image": "clips/../mine.png"}},
              "6": {"class_type": "LoadImage", "inputs": {"image": "nowhere.png"}},
              # A file inside the input folder named by its absolute path: the server would
              # refuse the path, so it is uploaded (one outside is refused: test_hostile_inputs).
              "7": {"class_type": "SeedVR2UpscaleVideoFile",
                    "inputs": {"video_path": str(tmp_path / "mine.png")}}}

    class Client:
        calls = []

        def upload(self, path, subfolder=""):
            self.calls.append((path, subfolder))
            return f"{subfolder}/up_{path.name}" if subfolder else f"up_{path.name}"

    client = Client()
    out = upload_inputs(client, prompt, info, tmp_path)
    assert client.calls == [(tmp_path / "mine.png", ""), (tmp_path / "clips" / "mine.mp4", "clips")]
    assert [out[i]["inputs"] for i in "1234567"] == [
        {"image": "up_mine.png"}, {"image": "theirs.png"}, {"file": "clips/up_mine.mp4"},
        {"video_path": "up_mine.png"}, {"image": "up_mine.png"}, {"image": "nowhere.png"},
        {"video_path": "up_mine.png"}]
    assert prompt["1"]["inputs"]["image"] == "mine.png"  # the given prompt is left alone


@pytest.mark.parametrize("channels", [1, 2])
def test_headless_save_video_writes_in_memory_audio(channels, tmp_path):
    """ComfyUI's AUDIO is a waveform in memory: headless SaveVideo encodes it (AAC), as
    ComfyUI's SaveVideo does; audio from a file is copied unchanged."""
    import av
    import torch

    from seedvr2.workflow.core_nodes import CORE_NODES

    nodes = {n.id: n for n in CORE_NODES}
    host = HeadlessHost(model_dir=tmp_path, output_dir=tmp_path / "out", quiet=True)
    rate, seconds = 44100, 0.5
    t = torch.arange(int(rate * seconds)) / rate
    waveform = torch.stack([torch.sin(2 * torch.pi * 440 * t * (c + 1)) * 0.5
                            for c in range(channels)])[None]
    images = torch.rand(12, 32, 48, 3)
    (video,) = nodes["CreateVideo"].run(host, images=images, fps=24.0, audio={
        "waveform": waveform, "sample_rate": rate}).outputs
    nodes["SaveVideo"].run(host, video=video, filename_prefix="v")
    (saved,) = host.saved
    assert probe_video(saved) == (12, (48, 32), True)
    with av.open(str(saved)) as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.rate, stream.channels) == ("aac", rate, channels)
        decoded = np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1)
    assert abs(decoded.shape[1] - len(t)) < 2048  # the encoder's priming and padding
    rms = np.sqrt((decoded[:, 2048:-2048] ** 2).mean(axis=1))
    assert np.allclose(rms, 0.5 / np.sqrt(2), rtol=0.1), rms  # the sines, not silence
    with pytest.raises(ValueError, match="5 channels; only mono or stereo can be encoded"):
        (video,) = nodes["CreateVideo"].run(host, images=images, fps=24.0, audio={
            "waveform": torch.zeros(1, 5, 100), "sample_rate": rate}).outputs
        nodes["SaveVideo"].run(host, video=video, filename_prefix="v")
