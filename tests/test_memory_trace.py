"""bench/memory_trace.py: the fake-tensor trace of a job's device memory agrees with a real
CPU run of the same job (tiny models, real weights), phase by phase, and the calibrated
budget's estimate lies in [1.0, 1.3] x the trace on a few real-size cells (the whole README
table is bench/RESULTS.md's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from seedvr2.loading import load_dit, load_vae
from seedvr2.models import window
from seedvr2.options import resolve_options
from seedvr2.pipeline.runner import Models

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import memory_trace  # noqa: E402

SIZE, INPUT = (96, 128), (48, 64)  # output and input frames (H, W)


def _opts(tiled: bool):
    return resolve_options(device="cpu", dtype="fp32", batch_size=5, resolution=SIZE[0],
                           vae_encode_tiled=tiled, vae_decode_tiled=tiled,
                           vae_encode_tile_size=64, vae_encode_tile_overlap=16,
                           vae_decode_tile_size=64, vae_decode_tile_overlap=16)


@pytest.mark.parametrize("tiled", [False, True])
def test_trace_matches_a_real_cpu_run(tiny_options, tiled):
    """The same phase functions on real tensors (CPU kernels, real attention) and on fake
    ones (with the fused-attention stand-in): the same activation peaks, byte for byte up to
    the RoPE tables a loaded model shares."""
    dit = load_dit(tiny_options["dit"], torch.float32, "cpu")
    vae = load_vae(tiny_options["vae"], torch.float32, "cpu")
    real = Models(dit, vae, torch.zeros(memory_trace.mem.TEXT_TOKENS, dit.config.txt_in_dim),
                  torch.device("cpu"), torch.device("cpu"), torch.float32)
    window._layouts.clear()  # a layout cached by an earlier test would not be allocated here
    measured = memory_trace.trace_phases(real, _opts(tiled), SIZE, INPUT, "cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = memory_trace.build_models(dit.config, vae.config, "cpu", torch.float32)
        traced = memory_trace.trace_phases(fake, _opts(tiled), SIZE, INPUT, "cpu")
    assert set(traced) == {"encode", "DiT", "decode"}
    for phase, peak in measured.items():
        assert peak > 0
        assert traced[phase] == pytest.approx(peak, rel=0.02), (phase, traced, measured)


def test_json_rows_and_calibrated_ratio():
    """One real-size cell through the command line: the rows the issue names, and the
    budget's estimate within [1.0, 1.3] of the trace in every phase."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "memory_trace.py"), "--model",
                             "3b", "--resolution", "720", "--batch-size", "5", "--setting",
                             "tiled", "--json"], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout)
    assert [r["phase"] for r in rows] == ["encode", "DiT", "decode"]
    for row in rows:
        assert set(row) == {"model", "resolution", "batch_size", "setting", "int8_cache",
                            "phase", "weights_bytes", "trace_bytes", "estimate_bytes"}
        assert (row["model"], row["resolution"], row["batch_size"], row["setting"],
                row["int8_cache"]) == ("3b", 720, 5, "tiled", "off")
        assert 0 < row["weights_bytes"] < row["trace_bytes"]
        assert 1.0 <= row["estimate_bytes"] / row["trace_bytes"] <= 1.3, row


@pytest.mark.parametrize("value, problem", [
    ("0", "must be at least 1"), ("100001", "must be at most 1001"),
    ("8", "must be 4n+1 (1, 5, 9, 13, 17, 21, ...); nearest valid values: 5 or 9")])
def test_batch_size_is_refused_as_the_option_table_refuses_it(value, problem, capsys):
    """Issue 44 §2.8: 100001 passed the 4n+1 test and ended in a traceback; the bench reads
    --batch-size with the option table's bounds and rule, in argparse's one line."""
    with pytest.raises(SystemExit) as refused:
        memory_trace.main(["--batch-size", value])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --batch-size {value}: {problem}")
