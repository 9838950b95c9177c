"""Every refusal is a SeedVR2Error (issue 41): the ones a user meets first, each with the
subclass that says what kind of thing is at fault and its exact message, and the command line
printing any of them as one ``error:`` line."""

from __future__ import annotations

import pytest
import torch

import seedvr2
from seedvr2.errors import InputError, SeedVR2Error
from seedvr2.options import OptionError, resolve_options


def _refusal(call) -> SeedVR2Error:
    with pytest.raises(SeedVR2Error) as caught:
        call()
    return caught.value


def test_loaded_modules_cannot_travel_to_worker_processes():
    module = torch.nn.Linear(1, 1)
    e = _refusal(lambda: seedvr2.upscale(torch.zeros(1, 16, 16, 3), dit=module, vae=module,
                                         devices="cpu,cpu"))
    assert type(e) is InputError and isinstance(e, ValueError)
    assert str(e) == ("several devices need the models by name or path (each worker loads its "
                      "own), not loaded modules")


@pytest.mark.parametrize("settings, message", [
    (dict(tile_size=100), "tile_size = 100: must be a positive multiple of 8 pixels (the VAE's "
                          "spatial factor); use 96 or 104"),
    (dict(tile_overlap=12), "tile_overlap = 12: must be a multiple of 8 pixels >= 0 (the VAE's "
                            "spatial factor); use 8 or 16"),
    (dict(tile_size=64, tile_overlap=64), "tile_overlap = 64 must be smaller than tile_size = "
                                          "64; lower the overlap (e.g. 8) or raise the tile size"),
    (dict(state_device="gpu"), "state_device = 'gpu': expected a device such as 'cpu' or "
                               "'cuda:0', or None for the VAE's device"),
])
def test_tile_settings_refuse_with_the_option_and_the_fix(settings, message):
    from seedvr2.memory.tiling import TileSettings

    e = _refusal(lambda: TileSettings(**{"tile_size": 256, "tile_overlap": 32, **settings}))
    assert type(e) is OptionError and str(e) == message


def test_a_plan_of_no_frames_is_refused():
    from seedvr2.pipeline.plan import make_plan

    e = _refusal(lambda: make_plan(0, resolve_options()))
    assert type(e) is InputError and str(e) == "the input has no frames"


def test_the_video_file_node_refuses_an_empty_path(tmp_path):
    from seedvr2.workflow import nodes as defs
    from seedvr2.workflow.host import HeadlessHost

    node = {n.id: n for n in defs.build_nodes()}["SeedVR2UpscaleVideoFile"]
    inputs = {i.name: i.default for i in node.inputs if i.is_widget}
    host = HeadlessHost(model_dir=tmp_path, input_dir=tmp_path, output_dir=tmp_path, quiet=True)
    e = _refusal(lambda: node.run(host, dit=None, vae=None, **{**inputs, "video_path": " "}))
    assert type(e) is InputError
    assert str(e) == "video_path is empty: give a video file in the input folder"


def test_the_command_line_prints_any_refusal_as_one_line(monkeypatch, capsys, tmp_path):
    """A SeedVR2Error that no command catches itself (here one the inspect command does not
    expect) is still one ``error:`` line and exit status 1, never a traceback."""
    from seedvr2 import cli
    from seedvr2.distributed.peers import DistributedError

    def refuse(path):
        raise DistributedError(f"{path}: refused")

    monkeypatch.setattr("seedvr2.loading.describe", refuse)
    assert cli.main(["inspect", str(tmp_path / "model.safetensors")]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'model.safetensors'}: refused\n"
