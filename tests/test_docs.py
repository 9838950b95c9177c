"""The documentation: generated parts current, every option, flag and node input documented,
every relative link leading somewhere."""

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from seedvr2.cli import build_parser
from seedvr2.workflow.nodes import build_nodes

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Written on the job-layer branch; linked from here before it lands. Remove when it has.


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_docs_are_current():
    for path, text in _gen_docs().generated().items():
        assert path.read_text() == text, \
            f"{path.relative_to(REPO)} is stale: run .venv/bin/python scripts/gen_docs.py"


def test_readme_is_short_and_answers_the_first_questions_first():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 12_000
    sections = re.findall(r"^## (.+)$", readme, re.M)
    assert {"Install", "Quick start"} <= set(sections[:4]), sections
    assert {"Choosing a model by VRAM", "Out of memory", "Development"} <= set(sections)
    # The two set-up commands, under Development (CI runs the test command).
    development = readme.split("## Development", 1)[1]
    assert "scripts/run.sh upscale" in development and "scripts/test.sh" in development


def test_vram_table_covers_every_released_dit_at_three_resolutions():
    from seedvr2.loading.registry import KNOWN_FILES

    readme = (REPO / "README.md").read_text()
    gen = _gen_docs()
    table = readme.split(gen.VRAM_START, 1)[1].split(gen.VRAM_END, 1)[0]
    assert "| DiT file | weights | 720p | 1080p | 2160p |" in table
    released = [n for n, k in KNOWN_FILES.items() if k.kind == "dit" and k.repo != "Comfy-Org/SeedVR2"]
    assert len(released) >= 7
    for name in released:
        row = next(line for line in table.splitlines() if f"`{name}`" in line)
        # weights, then three cells of three estimates each, in GiB
        assert len(re.findall(r"\d+\.\d", row)) == 1 + 3 * 3, row


def _cli_flags(parser: argparse.ArgumentParser, command: str = "seedvr2"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _cli_flags(sub, name)
        elif action.dest != "help":
            yield command, action.option_strings or [action.dest.upper()]


def test_options_page_names_every_flag_and_node_input():
    page = (REPO / "docs" / "options.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    missing = []
    for command, strings in _cli_flags(build_parser()):
        for flag in strings:
            if not any(f"`{flag}`" in row or f"`{flag}," in row or f" {flag}`" in row
                       for row in rows):
                missing.append(f"{command} {flag}")
    for node in build_nodes():
        short = node.display_name.removeprefix("SeedVR2 ")
        for inp in node.inputs:
            if not any(short in row and f"`{inp.name}`" in row for row in rows):
                missing.append(f"{short}: {inp.name}")
    assert not missing, missing


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def _relative_links(path: Path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in _relative_links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken


def test_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) `[code](no.md)` [web](https://x)\n")
    assert list(_relative_links(page)) == ["#title", "missing.md"]
    assert _anchors(page) == {"title"}


@pytest.mark.parametrize("heading, slug", [
    ("Weight formats, quantizing and downloads", "weight-formats-quantizing-and-downloads"),
    ("Without the editor: `seedvr2 run-workflow`", "without-the-editor-seedvr2-run-workflow"),
    ("Models, cache and ComfyUI's memory", "models-cache-and-comfyuis-memory"),
])
def test_heading_anchors_are_githubs(heading, slug):
    assert _slug(heading) == slug
