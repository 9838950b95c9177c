"""bench/gpu_checks.sh on a machine without a GPU: the script parses, its dry run builds
everything on meta and prints the plan as one table, and bad arguments get a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

SCRIPT = REPO / "bench" / "gpu_checks.sh"


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_dry_run_prints_the_plan_as_one_table():
    result = _run("--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("section"))
    table = lines[header:]
    assert [c.strip() for c in table[0].split(" | ")] == ["section", "measurement", "value", "note"]
    body = "\n".join(table)
    for expected in ("3.39 B parameters", "DiT forward 720p x 21", "DiT forward 1080p x 21",
                     "output (1, 3, 21, 1088, 1920)", "budget, 3B bf16 1080p x 21, untiled",
                     "budget, 3B bf16 1080p x 21, 512-px tiles", "0 / 16 / 32 blocks swapped",
                     "7B DiT forward 720p x 21, 2 of 36 blocks"):
        assert expected in body, expected
    assert sum(line.startswith("section") for line in lines) == 1  # one table


@pytest.mark.parametrize("args, message", [
    (["--dry-run", "--sections", "mfu,bogus"],
     "--sections 'mfu,bogus': unknown section(s) bogus; choose from dtype, blockswap, mfu, vae, e2e"),
    (["--dry-run", "--sections", ","], "unknown section(s) (none given)"),
    (["--dry-run", "--minutes", "0"], "--minutes 0.0: give a time between 0 and 60 minutes"),
    (["--dry-run", "--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_are_named(args, message):
    result = _run(*args)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_real_run_says_to_use_dry_run():
    result = _run("--sections", "dtype")
    assert result.returncode == 2
    assert "no CUDA device here" in result.stderr and "--dry-run" in result.stderr
