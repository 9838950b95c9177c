"""The node definitions: inputs from the option table, loader settings, running the nodes."""

from __future__ import annotations

import shutil

import pytest
import torch

from seedvr2.options import OPTIONS
from seedvr2.workflow import nodes as defs
from seedvr2.workflow.errors import WorkflowInterrupted
from seedvr2.workflow.host import HeadlessHost


def _by_id():
    return {n.id: n for n in defs.build_nodes()}


def test_every_input_has_a_tooltip_and_the_upscaler_follows_the_option_table():
    nodes = _by_id()
    assert sorted(nodes) == ["SeedVR2LoadDiTModel", "SeedVR2LoadVAEModel",
                             "SeedVR2TorchCompileSettings", "SeedVR2UpscaleVideo",
                             "SeedVR2UpscaleVideoFile", "SeedVR2VideoUpscaler"]
    for node in nodes.values():
        for inp in node.inputs:
            assert inp.tooltip, (node.id, inp.name)
    upscaler = nodes["SeedVR2VideoUpscaler"]
    file_upscaler = nodes["SeedVR2UpscaleVideoFile"]
    # Options of file jobs (resume) are inputs of the node that writes a file only.
    assert defs.FILE_JOB_OPTIONS == {"resume"}
    assert file_upscaler.input("resume").default is True
    assert "resume" not in {i.name for i in upscaler.inputs}
    for opt in defs.pipeline_options():
        inp = (file_upscaler if opt.name in defs.FILE_JOB_OPTIONS else upscaler).input(opt.name)
        auto = opt.accepts_auto  # an INT widget: 0 stands for "auto"
        assert (inp.default, inp.tooltip) == (opt.default, opt.help + (" (0 = auto)" if auto else ""))
        if opt.choices:
            assert (inp.type, inp.choices) == ("COMBO", tuple(opt.choices))
        if opt.type in (int, float):
            assert (inp.min, inp.max) == (0 if auto else opt.min, opt.max)
    for name in ("seed", "resolution", "max_resolution", "batch_size", "uniform_batch_size",
                 "temporal_overlap", "prepend_frames", "chunk_size", "color_correction",
                 "input_noise_scale", "latent_noise_scale"):
        assert upscaler.input(name)
    assert upscaler.input("seed").control_after_generate == "fixed"
    assert upscaler.input("offload_device").default == "cpu"
    assert upscaler.input("devices").default == "auto"
    # Options that belong to the loaders are not upscaler inputs.
    names = {i.name for i in upscaler.inputs}
    assert not names & {"device", "dtype", "text_embeddings", "dit_device", "blocks_to_swap"}


def test_loader_inputs_and_their_library_names():
    nodes = _by_id()
    assert [i.name for i in nodes["SeedVR2LoadDiTModel"].inputs] == [
        "model", "device", "offload_device", "cache_model", "blocks_to_swap",
        "swap_io_components", "attention_backend", "dtype", "text_embeddings",
        "compute_precision", "torch_compile_args"]
    # Added after the first release: optional, with the option's default and choices.
    precision = nodes["SeedVR2LoadDiTModel"].input("compute_precision")
    assert precision.optional and precision.default == "auto"
    assert list(precision.choices) == ["auto", "weights"]
    assert [i.name for i in nodes["SeedVR2LoadVAEModel"].inputs] == [
        "model", "device", "offload_device", "cache_model", "encode_tiled", "encode_tile_size",
        "encode_tile_overlap", "decode_tiled", "decode_tile_size", "decode_tile_overlap", "dtype",
        "tiling_exact", "encode_temporal_slice", "decode_temporal_slice", "cudnn_benchmark",
        "channels_last", "fp16_accumulation", "int8_cache", "torch_compile_args"]
    fp16 = nodes["SeedVR2LoadVAEModel"].input("fp16_accumulation")
    assert fp16.optional and fp16.default is False
    int8 = nodes["SeedVR2LoadVAEModel"].input("int8_cache")
    assert int8.optional and int8.default == "off" and list(int8.choices) == ["off", "on", "host"]
    options = {s.input: s.option for s in defs.LOADER_SETTINGS["vae"]}
    assert options["encode_tile_size"] == "vae_encode_tile_size"
    assert options["cache_model"] == "cache_vae"
    assert nodes["SeedVR2LoadDiTModel"].input("torch_compile_args").optional
    from seedvr2.models.attention import ATTENTION_BACKENDS

    assert defs.ATTENTION_BACKENDS == ATTENTION_BACKENDS


def _handles(tmp_path, **dit_settings):
    dit = {s.input: s.node_input().default for s in defs.LOADER_SETTINGS["dit"]}
    vae = {s.input: s.node_input().default for s in defs.LOADER_SETTINGS["vae"]}
    dit.update(dit_settings)
    return (defs.ModelHandle("dit", "d", str(tmp_path / "d"), tuple(dit.items())),
            defs.ModelHandle("vae", "v", str(tmp_path / "v"), tuple(vae.items())))


def test_loader_and_setting_inputs_come_from_the_option_table():
    """One source: every input that stands for a library option has that option's default,
    range, choices and help text; only the widget (device dropdown, step) is the node's."""
    nodes = _by_id()
    groups = [(nodes["SeedVR2LoadDiTModel"], defs.LOADER_SETTINGS["dit"]),
              (nodes["SeedVR2LoadVAEModel"], defs.LOADER_SETTINGS["vae"]),
              (nodes["SeedVR2VideoUpscaler"], defs.UPSCALER_SETTINGS),
              (nodes["SeedVR2UpscaleVideoFile"], defs.UPSCALER_SETTINGS)]
    checked = set()
    for node, settings in groups:
        for setting in settings:
            inp = node.input(setting.input)
            if setting.to_options is not None:
                assert inp.type == defs.COMPILE_TYPE and inp.optional
                continue
            opt = OPTIONS[setting.option]
            assert (inp.default, inp.tooltip) == (opt.default, opt.help), (node.id, inp.name)
            assert (inp.min, inp.max) == (opt.min, opt.max), (node.id, inp.name)
            if opt.choices:
                assert (inp.type, inp.choices) == ("COMBO", tuple(opt.choices))
            elif inp.type == "COMBO":  # a device dropdown: its default is one of its choices
                assert callable(inp.choices) and opt.default in inp.choices(None)
            else:
                assert inp.type == {bool: "BOOLEAN", int: "INT", float: "FLOAT", str: "STRING"}[
                    opt.type], (node.id, inp.name)
            checked.add(setting.option)
    assert {"dit_device", "vae_offload_device", "cache_dit", "vae_encode_tile_size",
            "vae_decode_tile_overlap", "dtype", "blocks_to_swap", "tensor_offload_device",
            "devices"} <= checked
    assert nodes["SeedVR2LoadVAEModel"].input("encode_tile_size").step == 8
    compile_node = nodes["SeedVR2TorchCompileSettings"]
    for field, option in defs.COMPILE_FIELDS.items():
        inp = compile_node.input(field)
        if option in OPTIONS:
            opt = OPTIONS[option]
            assert (inp.default, inp.tooltip) == (opt.default, opt.help), field
            assert inp.choices == opt.choices, field
        else:
            assert inp.default == defs.COMPILE_LIMIT_DEFAULTS[field]


FIRST_RELEASE_SETTINGS = {  # in widget order (saved workflows hold their values by position)
    "dit": ["device", "offload_device", "cache_model", "blocks_to_swap", "swap_io_components",
            "attention_backend", "dtype", "text_embeddings"],
    "vae": ["device", "offload_device", "cache_model", "encode_tiled", "encode_tile_size",
            "encode_tile_overlap", "decode_tiled", "decode_tile_size", "decode_tile_overlap",
            "dtype"],
}


def test_settings_added_after_the_first_release_are_optional(monkeypatch):
    nodes = _by_id()
    for kind, node_id in (("dit", "SeedVR2LoadDiTModel"), ("vae", "SeedVR2LoadVAEModel")):
        settings = nodes[node_id].inputs[1:]
        assert [i.name for i in settings[:defs.FIRST_RELEASE_SETTINGS[kind]]] == \
            FIRST_RELEASE_SETTINGS[kind]
        for index, inp in enumerate(settings):
            first = index < defs.FIRST_RELEASE_SETTINGS[kind]
            assert inp.optional is (not first or inp.name == "torch_compile_args"), inp.name
    # A new loader setting: an optional input with its option's default, left out of old
    # workflows (and of their handles) without a complaint.
    later = defs.Setting("swap_later", "blocks_to_swap")
    monkeypatch.setitem(defs.LOADER_SETTINGS, "dit", (*defs.LOADER_SETTINGS["dit"], later))
    (inp,) = [i for i in defs.settings_inputs("dit") if i.name == "swap_later"]
    assert inp.optional and inp.default == OPTIONS["blocks_to_swap"].default


def test_disagreeing_loaders_and_unknown_compile_limits_are_reported(tmp_path):
    dit, vae = _handles(tmp_path, dtype="fp16")
    job = defs.facade_request(dit, vae, {"devices": "auto", "offload_device": "cpu"}, {"seed": 1})
    assert job.options["dtype"] == "fp16" and job.options["seed"] == 1
    assert job.options["dit_device"] == "auto" and job.options["cache_vae"] is False
    assert job.notes == ["dtype = 'auto' (SeedVR2 Load VAE Model) differs from 'fp16' (SeedVR2 "
                         "Load DiT Model): one dtype for both models is supported; using 'fp16'"]
    args = {"backend": "inductor", "mode": "default", "fullgraph": False, "dynamic": "auto",
            "dynamo_cache_size_limit": 8, "dynamo_recompile_limit": 128}
    dit, vae = _handles(tmp_path, torch_compile_args=args)
    job = defs.facade_request(dit, vae, {}, {})
    assert job.unsupported == ["torch_compile_args.dynamo_cache_size_limit = 8 (SeedVR2 Load "
                               "DiT Model) is not supported yet; ignored"]
    dit, vae = _handles(tmp_path)
    assert defs.facade_request(dit, vae, {}, {}).unsupported == []  # defaults ask for nothing


def test_compile_settings_become_compile_options(tmp_path):
    args = defs.build_nodes()[2].run(None, backend="inductor", mode="max-autotune",
                                     fullgraph=False, dynamic="auto", dynamo_cache_size_limit=64,
                                     dynamo_recompile_limit=128).outputs[0]
    dit, vae = _handles(tmp_path, torch_compile_args=args)
    job = defs.facade_request(dit, vae, {}, {})
    if "compile" in OPTIONS:
        assert job.options["compile"] is True and job.options["compile_mode"] == "max-autotune"
    else:
        assert job.unsupported[0] == ("torch_compile_args.compile = True (SeedVR2 Load DiT "
                                      "Model) is not supported yet; ignored")


def _tiny_loaders(nodes, host):
    """The DiT and VAE loader nodes' outputs for the tiny models in fp32."""
    dit = nodes["SeedVR2LoadDiTModel"].run(host, model="dit3b_tiny.safetensors",
                                           **{**_defaults("dit"), "dtype": "fp32"}).outputs[0]
    vae = nodes["SeedVR2LoadVAEModel"].run(host, model="vae_tiny.safetensors",
                                           **{**_defaults("vae"), "dtype": "fp32"}).outputs[0]
    return dit, vae


def test_upscaler_node_keeps_rgba_and_reports_progress(tiny_model_dir, tmp_path):
    host = HeadlessHost(model_dir=tiny_model_dir, output_dir=tmp_path, quiet=True)
    seen = []
    host.progress = lambda value, total: seen.append((value, total))
    nodes = _by_id()
    dit, vae = _tiny_loaders(nodes, host)
    assert dit.path == str(tiny_model_dir / "dit3b_tiny.safetensors")
    image = torch.rand(2, 24, 32, 4)
    inputs = {i.name: i.default for i in nodes["SeedVR2VideoUpscaler"].inputs if i.is_widget}
    out = nodes["SeedVR2VideoUpscaler"].run(host, image=image, dit=dit, vae=vae,
                                            **{**inputs, "resolution": 32, "batch_size": 1}).outputs[0]
    assert out.shape == (2, 32, 42, 4) and out.dtype == torch.float32
    assert seen[-1] == (6, 6)  # encode + DiT + decode of two batches


def test_the_upscaler_node_asks_its_host_for_the_job_s_room(tiny_model_dir, tmp_path):
    """ComfyUI's idle models stay resident under dynamic VRAM until memory is demanded: the
    node hands its host's ``make_room`` to the job, which asks for its estimate (activations
    included) on its device before measuring free memory."""
    host = HeadlessHost(model_dir=tiny_model_dir, output_dir=tmp_path, quiet=True)
    asked = []
    host.make_room = lambda device, need: asked.append((device, need))
    nodes = _by_id()
    dit, vae = _tiny_loaders(nodes, host)
    inputs = {i.name: i.default for i in nodes["SeedVR2VideoUpscaler"].inputs if i.is_widget}
    nodes["SeedVR2VideoUpscaler"].run(host, image=torch.rand(1, 16, 16, 3), dit=dit, vae=vae,
                                      **{**inputs, "resolution": 16, "batch_size": 1})
    assert [device for device, _ in asked] == ["cpu"] and asked[0][1] > 0


def test_the_video_file_node_resolves_its_options_once_and_plans_once(tiny_model_dir,
                                                                      tmp_path, monkeypatch):
    """Upscale Video File turns its inputs into options once and hands them resolved to the
    facade (three resolutions and two requests per run before)."""
    import seedvr2.api
    from conftest import make_clip
    from seedvr2.options import resolve_options

    (tmp_path / "in").mkdir()
    make_clip(tmp_path / "in" / "clip.mp4", frames=5)
    host = HeadlessHost(model_dir=tiny_model_dir, output_dir=tmp_path / "out",
                        input_dir=tmp_path / "in", quiet=True)
    calls = []
    counted = lambda name, f: lambda *a, **k: calls.append(name) or f(*a, **k)  # noqa: E731
    monkeypatch.setattr(defs, "resolve_options", counted("resolve", resolve_options))
    monkeypatch.setattr(seedvr2.api, "resolve_options", counted("resolve", resolve_options))
    monkeypatch.setattr(defs, "facade_request", counted("request", defs.facade_request))
    nodes = _by_id()
    dit, vae = _tiny_loaders(nodes, host)
    calls.clear()  # the loaders check their own settings
    inputs = {i.name: i.default for i in nodes["SeedVR2UpscaleVideoFile"].inputs if i.is_widget}
    out = nodes["SeedVR2UpscaleVideoFile"].run(host, dit=dit, vae=vae, **{
        **inputs, "video_path": "clip.mp4", "resolution": 32, "batch_size": 5}).outputs[0]
    assert out.endswith(".mp4") and calls == ["request", "resolve"]


def _defaults(kind):
    return {s.input: s.node_input().default for s in defs.LOADER_SETTINGS[kind]
            if not s.node_input().optional}


def test_interrupt_stops_the_node_with_nothing_kept(tiny_model_dir, tmp_path):
    host = HeadlessHost(model_dir=tiny_model_dir, output_dir=tmp_path, quiet=True)
    host.stop.set()
    nodes = _by_id()
    dit = nodes["SeedVR2LoadDiTModel"].run(host, model="dit3b_tiny.safetensors",
                                           **_defaults("dit")).outputs[0]
    vae = nodes["SeedVR2LoadVAEModel"].run(host, model="vae_tiny.safetensors",
                                           **_defaults("vae")).outputs[0]
    inputs = {i.name: i.default for i in nodes["SeedVR2VideoUpscaler"].inputs if i.is_widget}
    with pytest.raises(WorkflowInterrupted, match="^interrupted$"):
        nodes["SeedVR2VideoUpscaler"].run(host, image=torch.rand(1, 16, 16, 3), dit=dit, vae=vae,
                                          **{**inputs, "resolution": 16, "batch_size": 1})


def test_model_dropdown_lists_local_files_first_then_downloads(tiny_model_dir, tmp_path):
    """The files the user has come first (a new node's default is one that runs), then the
    released files still to download, which the spec lists for the editor to label."""
    from seedvr2.loading.registry import KNOWN_FILES

    nodes = _by_id()
    host = HeadlessHost(model_dir=tiny_model_dir)
    dits = defs.model_choices(host, "dit")
    vaes = defs.model_choices(host, "vae")
    # ComfyUI's native files are listed when present, never offered (ours are, the same models).
    registered_dits = [n for n, k in KNOWN_FILES.items()
                       if k.kind == "dit" and k.repo != "Comfy-Org/SeedVR2"]
    assert dits == ["dit3b_tiny.safetensors", *registered_dits]
    assert vaes == ["vae_tiny.safetensors", "ema_vae_fp16.safetensors"]
    assert "text_64.safetensors" not in dits + vaes
    model = nodes["SeedVR2LoadDiTModel"].input("model")
    options, extra = defs.input_spec(model, host)
    assert extra["default"] == "dit3b_tiny.safetensors"
    assert list(extra[defs.DOWNLOADS_KEY]) == registered_dits
    # A released file the user has is local: listed first, not marked.
    shutil.copy(tiny_model_dir / "vae_tiny.safetensors", tmp_path / "ema_vae_fp16.safetensors")
    host = HeadlessHost(model_dir=tmp_path)
    vae = nodes["SeedVR2LoadVAEModel"].input("model")
    options, extra = defs.input_spec(vae, host)
    assert options == ["ema_vae_fp16.safetensors"] and extra["default"] == options[0]
    assert extra[defs.DOWNLOADS_KEY] == {}


def test_comfy_folder_name_matches_the_registry():
    import importlib.util

    from seedvr2.loading.registry import COMFY_FOLDER

    spec = importlib.util.find_spec("seedvr2")
    text = (spec.origin and open(spec.origin.replace("src/seedvr2/__init__.py", "nodes.py")).read())
    assert f'COMFY_FOLDER = "{COMFY_FOLDER}"' in text


def test_batch_size_zero_means_auto():
    dit = defs.ModelHandle("dit", "dit.safetensors", "/m/dit.safetensors")
    vae = defs.ModelHandle("vae", "vae.safetensors", "/m/vae.safetensors")
    assert defs.facade_request(dit, vae, {}, {"batch_size": 0}).options["batch_size"] == "auto"
    assert defs.facade_request(dit, vae, {}, {"batch_size": 9}).options["batch_size"] == 9


def test_video_path_lists_input_videos_with_an_upload_button_and_takes_typed_paths(tmp_path):
    from seedvr2.workflow.execute import coerce

    (tmp_path / "clip.mp4").write_bytes(b"")
    (tmp_path / "photo.png").write_bytes(b"")
    host = HeadlessHost(model_dir=tmp_path, input_dir=tmp_path)
    video_path = _by_id()["SeedVR2UpscaleVideoFile"].input("video_path")
    options, extra = defs.input_spec(video_path, host)
    assert options == ["clip.mp4"] and extra["default"] == "clip.mp4"
    assert extra["video_upload"] is True
    assert coerce(video_path, "/elsewhere/film.mkv", host) == "/elsewhere/film.mkv"


@pytest.mark.parametrize("name", ["/etc/passwd", "../../x.mp4", "sub/../../x.mp4", "~/x.mp4",
                                  "x.mp4 [output]/../../../x"])
def test_video_path_outside_the_input_folder_is_refused(tmp_path, name):
    """A prompt names files inside the input folder only: an absolute path or '..' would let
    anyone who reaches a --listen server read any file it can open."""
    (tmp_path / "in").mkdir()
    host = HeadlessHost(model_dir=tmp_path, input_dir=tmp_path / "in", output_dir=tmp_path / "out")
    dit = defs.ModelHandle("dit", "dit.safetensors", "/m/dit.safetensors")
    vae = defs.ModelHandle("vae", "vae.safetensors", "/m/vae.safetensors")
    node = _by_id()["SeedVR2UpscaleVideoFile"]
    inputs = {i.name: i.default for i in node.inputs if i.is_widget}
    with pytest.raises(ValueError) as error:
        node.run(host, dit=dit, vae=vae, **{**inputs, "video_path": name})
    assert str(error.value) == (
        f"video_path = {name!r}: {name!r} is not a file name in the input folder: only files "
        f"inside it are read "
        f"(subfolders allowed; 'name [output]' for the output folder), never an absolute path, "
        f"'~' or '..'. Upload the file or copy it into {tmp_path / 'in'}")


def test_input_names_inside_the_folders_resolve_there(tmp_path):
    from seedvr2.workflow.host import confined_input_path

    folders = {"input": tmp_path / "in", "output": tmp_path / "out", "temp": tmp_path / "tmp"}
    assert confined_input_path("a/b.mp4", folders) == tmp_path / "in" / "a" / "b.mp4"
    assert confined_input_path("a/../b.mp4", folders) == tmp_path / "in" / "b.mp4"
    assert confined_input_path("b.mp4 [output]", folders) == tmp_path / "out" / "b.mp4"
    assert confined_input_path("b.mp4 [temp]", folders) == tmp_path / "tmp" / "b.mp4"
    assert confined_input_path("b.mp4 [input]", folders) == tmp_path / "in" / "b.mp4"
    with pytest.raises(ValueError, match=r"^'\.\./b\.mp4 \[output\]' is not a file name in "
                                         r"the output folder"):
        confined_input_path("../b.mp4 [output]", folders)


def test_a_core_node_with_one_of_our_ids_is_reported_as_core_keeping_its_own(tmp_path):
    """ComfyUI loads custom nodes with ignore=base_node_names: a core node (comfy_extras) with
    one of our IDs stays and ours is dropped. The log says so, not that ours replace it; another
    pack's clash is still reported as before. (Classic path: no comfy_api here.)"""
    from conftest import import_pack_beside

    ours, result = import_pack_beside(tmp_path, """
        # ComfyUI's core, loaded: a comfy_extras node and one of nodes.py's own (no module set)
        extras = type("SeedVR2UpscaleVideo", (), {
            "RELATIVE_PYTHON_MODULE": "comfy_extras.nodes_seedvr"})
        builtin = type("SeedVR2LoadVAEModel", (), {})
        nodes.NODE_CLASS_MAPPINGS = {"SeedVR2UpscaleVideo": extras,
                                     "SeedVR2LoadVAEModel": builtin, "LoadImage": builtin}
    """)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "SeedVR2: ComfyUI's core registers the node IDs SeedVR2LoadVAEModel, SeedVR2UpscaleVideo "
        "(comfy_extras.nodes_seedvr, nodes): ComfyUI keeps its own and does not load this "
        "pack's SeedVR2LoadVAEModel, SeedVR2UpscaleVideo: workflows with these IDs run "
        "ComfyUI's nodes. Use ComfyUI's nodes there, or a release of this pack with other IDs."]
