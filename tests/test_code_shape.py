"""The job layer's shape, measured: short functions with few parameters, test faults read in
one module, results never patched into objects (issue 24)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "seedvr2"
JOB_LAYER = [SRC / "api.py", *sorted((SRC / "pipeline").glob("*.py")),
             *sorted((SRC / "distributed").glob("*.py"))]
MAX_LINES, MAX_PARAMETERS = 60, 7
PUBLIC_KEYWORDS = {"upscale", "upscale_file"}  # the facade's keywords are the library's API


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            if named and named[0].arg in ("self", "cls"):
                named = named[1:]
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1, len(named)


def test_job_layer_functions_are_short_and_narrow():
    too_long = [f"{p.relative_to(SRC)}:{line} {name} ({length} lines)"
                for p in JOB_LAYER for name, line, length, _ in _functions(p)
                if length > MAX_LINES]
    too_wide = [f"{p.relative_to(SRC)}:{line} {name} ({count} parameters)"
                for p in JOB_LAYER for name, line, _, count in _functions(p)
                if count > MAX_PARAMETERS and name not in PUBLIC_KEYWORDS]
    assert (too_long, too_wide) == ([], [])


# Over all of src/: issue 41 asks for at most 2 functions past MAX_LINES and 4 past
# MAX_PARAMETERS (the facade's keywords not counted); these ceilings hold what is left on the
# way there, and only ever come down.
SRC_LONG_CEILING, SRC_WIDE_CEILING = 6, 6


def test_src_functions_stay_within_the_ceilings():
    found = [(p.relative_to(SRC), *f) for p in sorted(SRC.rglob("*.py")) for f in _functions(p)]
    too_long = [f"{p}:{line} {name}" for p, name, line, length, _ in found if length > MAX_LINES]
    too_wide = [f"{p}:{line} {name}" for p, name, line, _, count in found
                if count > MAX_PARAMETERS and name not in PUBLIC_KEYWORDS]
    assert len(too_long) <= SRC_LONG_CEILING, too_long
    assert len(too_wide) <= SRC_WIDE_CEILING, too_wide


def test_the_measure_sees_a_long_wide_function(tmp_path):
    """The check above can fail: a 61-line function of 8 parameters is caught."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    sample = tmp_path / "sample.py"
    sample.write_text(f"def wide(a, b, c, d, e, f, g, h):\n{body}\n    return x0\n")
    assert list(_functions(sample)) == [("wide", 1, 61, 8)]


TEST_SWITCH = re.compile(r"SEEDVR2_(KILL_AT|KILL_IN_ASSEMBLY|SEGMENT_FRAMES|CHECKPOINT_SECONDS|"
                         r"FAULT|FAULT_MARK|SLOW|TEST_[A-Z_]+)\b")


def test_test_faults_are_read_in_one_module_and_nothing_is_patched_in():
    sources = {p.relative_to(SRC).as_posix(): p.read_text() for p in SRC.rglob("*.py")}
    assert sorted(name for name, text in sources.items() if TEST_SWITCH.search(text)) == \
        ["faults.py"]
    assert [name for name, text in sources.items() if "__dict__.update" in text] == []
