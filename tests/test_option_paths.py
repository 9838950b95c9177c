"""The way an option travels (issue 41): a newcomer following ``batch_size`` or ``fit`` from the
command line or a node to where it acts enters no module more than twice.

Measured on real runs: the call stack at the moment the option acts (``make_plan`` cuts the
batches, ``fit_options`` fits the job) read from the entry point down, consecutive frames of one
module counted as one visit. Today both read ``cli`` (or ``workflow.nodes``) -> ``api`` ->
``pipeline.plan``, and ... -> ``api`` -> ``pipeline.job`` -> ``memory.fit``."""

from __future__ import annotations

import sys
import threading
from collections import Counter

import pytest
import torch

from conftest import make_clip
from test_nodes import _tiny_loaders
from seedvr2.cli import main
from seedvr2.memory import fit
from seedvr2.pipeline import plan
from seedvr2.workflow import nodes as defs
from seedvr2.workflow.host import HeadlessHost

WHERE_IT_ACTS = {"batch_size": plan.make_plan, "fit": fit.fit_options}
MAX_VISITS = 2


def visits(path: list[str]) -> list[str]:
    """``a a b a`` -> ``a b a``: one entry per visit."""
    return [m for i, m in enumerate(path) if i == 0 or path[i - 1] != m]


def test_visits_count_entries_not_frames():
    assert visits(["cli", "cli", "api", "cli", "plan"]) == ["cli", "api", "cli", "plan"]
    back_and_forth = ["cli", "api", "pipeline.job", "api", "pipeline.job", "api", "memory.fit"]
    with pytest.raises(AssertionError, match="api -> pipeline.job -> api"):
        _check({"batch_size": ["cli", "api", "pipeline.plan"], "fit": back_and_forth})


def _paths(run) -> dict[str, list[str]]:
    """Each option's module path (entry first) the first time its function is called."""
    codes = {fn.__code__: option for option, fn in WHERE_IT_ACTS.items()}
    found: dict[str, list[str]] = {}

    def watch(frame, event, arg):
        option = codes.get(frame.f_code) if event == "call" else None
        if option is None or option in found:
            return
        stack = []
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("seedvr2"):
                stack.append(module.removeprefix("seedvr2."))
            frame = frame.f_back
        found[option] = stack[::-1]

    sys.setprofile(watch)
    threading.setprofile(watch)  # the job may run in a thread of its own
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return found


def _check(paths: dict[str, list[str]]):
    assert sorted(paths) == sorted(WHERE_IT_ACTS)
    for option, path in paths.items():
        counts = Counter(visits(path))
        assert max(counts.values()) <= MAX_VISITS, (option, " -> ".join(visits(path)))


def test_from_the_command_line(tiny_options, tmp_path):
    clip = tmp_path / "clip.mp4"
    make_clip(clip, frames=5)
    args = ["upscale", str(clip), "-o", str(tmp_path / "up.mp4"), "--dit", tiny_options["dit"],
            "--vae", tiny_options["vae"], "--model-dir", str(tiny_options["model_dir"]),
            "--device", "cpu", "--dtype", "fp32", "--resolution", "32", "--batch-size", "5",
            "--fit", "auto", "--quiet"]
    paths = _paths(lambda: main(args))
    assert (tmp_path / "up.mp4").exists()
    _check(paths)


@pytest.mark.parametrize("node", ["SeedVR2VideoUpscaler", "SeedVR2UpscaleVideoFile"])
def test_from_a_node(node, tiny_model_dir, tmp_path):
    (tmp_path / "in").mkdir()
    make_clip(tmp_path / "in" / "clip.mp4", frames=5)
    host = HeadlessHost(model_dir=tiny_model_dir, output_dir=tmp_path / "out",
                        input_dir=tmp_path / "in", quiet=True)
    by_id = {n.id: n for n in defs.build_nodes()}
    dit, vae = _tiny_loaders(by_id, host)
    inputs = {i.name: i.default for i in by_id[node].inputs if i.is_widget}
    given = {"resolution": 32, "batch_size": 5, "fit": "auto"}
    given |= {"video_path": "clip.mp4"} if node == "SeedVR2UpscaleVideoFile" else \
        {"image": torch.rand(5, 16, 16, 3)}
    _check(_paths(lambda: by_id[node].run(host, dit=dit, vae=vae, **{**inputs, **given})))
