"""The pack as the Comfy Registry and ComfyUI-Manager read it: pyproject.toml's fields checked
against the registry's published specification (docs.comfy.org/registry/specifications) one by
one and read back by ComfyUI's own parser, the pictures they point at, and node_list.json (the
node IDs ComfyUI-Manager's static scan cannot find: ours are built at run time)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib

from PIL import Image

from conftest import REPO, custom_node_import

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT, COMFY = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
REPOSITORY = PROJECT["urls"]["Repository"]
# Where GitHub serves a file of the default branch (the registry loads the pictures from there).
RAW = REPOSITORY.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"

# The classifiers the registry reads (and the only values it accepts for them).
REGISTRY_OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
REGISTRY_ACCELERATORS = ("GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc",
                         "NPU :: Huawei Ascend", "GPU :: Apple Metal")


def test_project_fields_follow_the_registry_specification():
    name = PROJECT["name"]
    # name: the node's registry id: < 100 characters of letters, digits, - _ . without two
    # special characters in a row, not starting with a digit or a special character.
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*([-_.][A-Za-z0-9]+)*", name)
    assert re.fullmatch(r"\d+\.\d+\.\d+", PROJECT["version"])  # X.Y.Z
    assert set(PROJECT["license"]) in ({"text"}, {"file"})  # license = { text = ... } / { file }
    assert PROJECT["description"] and PROJECT["requires-python"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", REPOSITORY)
    # Only true classifiers: Linux is where the suite runs; NVIDIA CUDA is what the GPU paths
    # are built and checked for. Each is one the registry accepts.
    os_values = [c.removeprefix("Operating System :: ") for c in PROJECT["classifiers"]
                 if c.startswith("Operating System :: ")]
    accelerators = [c.removeprefix("Environment :: ") for c in PROJECT["classifiers"]
                    if c.startswith("Environment :: ")]
    assert os_values == ["POSIX :: Linux"] and accelerators == ["GPU :: NVIDIA CUDA"]
    assert all(v.startswith(REGISTRY_OS_PREFIXES) for v in os_values)
    assert all(v in REGISTRY_ACCELERATORS for v in accelerators)


def test_tool_comfy_fields_and_the_pictures_they_point_at():
    assert set(COMFY) == {"PublisherId", "DisplayName", "Icon", "Banner", "requires-comfyui"}
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", COMFY["PublisherId"])
    assert COMFY["DisplayName"] == "SeedVR2 Video Upscaler"
    # The oldest ComfyUI the tests run (tests/test_comfyui_server.py), in the registry's
    # [operator]major.minor.patch form.
    assert COMFY["requires-comfyui"] == ">=0.3.75"
    comfyui = (REPO / ".comfyui-test" / "ComfyUI" / "comfyui_version.py")
    if comfyui.is_file():  # installed by the server tests
        assert '__version__ = "0.3.75"' in comfyui.read_text()
    pictures = {}
    for field, path in (("Icon", "docs/assets/icon.png"), ("Banner", "docs/assets/banner.png")):
        assert COMFY[field] == RAW + path, field  # served from this repository
        with Image.open(REPO / path) as im:
            pictures[field] = (im.format, im.size)
        assert (REPO / path).stat().st_size < 40_000, field  # small in the repository
    assert pictures["Icon"][0] == "PNG" and pictures["Icon"][1][0] == pictures["Icon"][1][1] <= 400
    width, height = pictures["Banner"][1]
    assert pictures["Banner"][0] == "PNG" and width * 9 == height * 21


def test_the_repository_address_is_the_same_everywhere():
    """One address, named in pyproject.toml: the README's install line clones it."""
    readme = (REPO / "README.md").read_text()
    clones = re.findall(r"git clone (\S+)", readme)
    assert clones == [REPOSITORY]
    assert f"*Install via Git URL* with `{REPOSITORY}`" in readme


def test_comfyui_reads_the_fields_as_meant():
    """ComfyUI's own reader of a pack's pyproject.toml (comfy_config.config_parser, kept in step
    with comfy-cli's, which ``comfy node validate`` runs) in the test ComfyUI 0.3.75."""
    from test_comfyui_server import _install

    comfy_dir, python = _install()
    code = ("import json, sys; from comfy_config import config_parser; "
            "print(config_parser.extract_node_configuration(sys.argv[1]).model_dump_json())")
    result = subprocess.run([str(python), "-c", code, str(REPO)], cwd=comfy_dir,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    read = json.loads(result.stdout)
    project, comfy = read["project"], read["tool_comfy"]
    assert project["supported_os"] == ["POSIX :: Linux"]  # [] when one is not accepted
    assert project["supported_accelerators"] == ["GPU :: NVIDIA CUDA"]
    assert project["supported_comfyui_version"] == ">=0.3.75"
    assert project["urls"]["repository"] == REPOSITORY
    assert (comfy["publisher_id"], comfy["display_name"], comfy["icon"]) == \
        (COMFY["PublisherId"], COMFY["DisplayName"], COMFY["Icon"])


def test_node_list_names_every_node_the_pack_registers():
    """ComfyUI-Manager's scanner adds node_list.json's keys to the pack's node map ("install
    missing nodes"); our NODE_CLASS_MAPPINGS is built at run time, which its scan cannot read."""
    from seedvr2.workflow.nodes import build_nodes

    expected = {node.id: node.display_name for node in build_nodes()}
    listed = json.loads((REPO / "node_list.json").read_text())
    assert listed == expected, ("node_list.json is stale; write:\n"
                                + json.dumps(expected, indent=2))


def _archive_files() -> list[str]:
    """The files the registry's archive holds, chosen as ``comfy node pack`` chooses them
    (comfy-cli 1.23.0, ``file_utils.zip_files``): the git-tracked files that exist, minus
    .comfyignore's gitignore-style patterns (blank lines and ``#`` comments skipped)."""
    import warnings

    import pathspec

    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True,
                             text=True, check=True).stdout.splitlines()
    lines = [line.strip() for line in (REPO / ".comfyignore").read_text().splitlines()]
    with warnings.catch_warnings():  # comfy-cli's pattern style, deprecated in pathspec 1.x
        warnings.simplefilter("ignore", DeprecationWarning)
        ignored = pathspec.PathSpec.from_lines("gitwildmatch",
                                               [p for p in lines if p and not p.startswith("#")])
    return [f for f in tracked if not ignored.match_file(f) and (REPO / f).is_file()]


def test_the_registry_archive_imports_and_registers_every_node(tmp_path):
    """What a user installs from the registry: no tests, benchmarks or development scripts,
    and the rest, in a custom-node folder of another name, imports as ComfyUI imports it,
    registers every node of node_list.json and builds the models from its own configs."""
    import shutil
    import sys
    import textwrap

    files = _archive_files()
    left_out = ("tests/", "bench/", "scripts/", ".ci/")
    assert [f for f in files if f.startswith(left_out)] == []
    assert {"__init__.py", "nodes.py", "pyproject.toml", "requirements.txt", "web/seedvr2.js",
            "src/seedvr2/api.py", "configs/dit_3b.json"} <= set(files)
    folder = tmp_path / "custom_nodes" / "seedvr2-comfyui.registry"
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, folder / name)
    code = custom_node_import(folder) + textwrap.dedent("""
        import torch
        print(sorted(module.NODE_CLASS_MAPPINGS), module.WEB_DIRECTORY)
        models = importlib.import_module(spec.name + ".src.seedvr2.models")
        with torch.device("meta"):
            print(sum(p.numel() for p in models.build_dit("3b").parameters()),
                  models.__file__.startswith(path))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    listed = sorted(json.loads((REPO / "node_list.json").read_text()))
    assert done.stdout.splitlines() == [f"{listed} ./web", "3391475776 True"]
