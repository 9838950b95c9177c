"""bench/gpu_checks.sh without a GPU: the rehearsal runs every section end to end on the CPU
(as the GPU machine's Python would: PyAV and gguf made unimportable) and every row holds a
measured value (lowp's through comfy-kitchen's eager backend where it is installed, one
skipped row naming how to get it where not); a section past its time cap is stopped with the rows so far kept; bad
arguments get one clear error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO

SCRIPT = REPO / "bench" / "gpu_checks.sh"
sys.path.insert(0, str(REPO / "bench"))

import gpu_checks  # noqa: E402

# Rows whose value is a name, not a number: the machine and what auto chose or ran.
NAMED_VALUES = {("env", "device"), ("env", "software"), ("env", "dtype=auto chose"),
                ("env", "attention_backend=auto runs")}


def _run(*args, env=None, timeout=600):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)


def _importable(module: str, **env) -> bool:
    """Whether the rehearsal's interpreter, with this environment, finds ``module``."""
    code = f"import importlib.util; print(importlib.util.find_spec({module!r}) is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, **env))
    return out.stdout.strip() == "True"


def _rows(markdown: str) -> list[tuple[str, ...]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert lines[0] == "| section | measurement | value | note |"
    return [tuple(cell.strip() for cell in line[2:-2].split(" | ")) for line in lines[1:]]


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_rehearsal_measures_every_section_without_pyav_or_gguf(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    # As on the GPU machine: neither package can be imported.
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['av'] = None\n"
                                              "sys.modules['gguf'] = None\n")
    out = tmp_path / "out"
    result = _run("--rehearse", env={"OUT": str(out), "PYTHONPATH": str(blocker)})
    assert result.returncode == 0, result.stderr[-3000:]
    written = (out / "gpu_checks.md").read_text()
    rows = _rows(written)
    assert _rows(result.stdout) == rows  # the file holds the table stdout ends with
    assert [s for s in gpu_checks.SECTIONS if not any(r[0] == s for r in rows)] == []
    kitchen = _importable("comfy_kitchen", PYTHONPATH=str(blocker))
    for section, what, value, note in rows:
        if section == "lowp" and not kitchen:  # the suite also runs without the kitchen extra
            assert (what, value, note) == ("(section)", "skipped", gpu_checks.KITCHEN_WHEEL)
            continue
        assert value not in ("error", "skipped", ""), (section, what, value, note)
        if (section, what) in NAMED_VALUES or what.startswith("attention kernel"):
            assert re.fullmatch(r"[\w.+ ()-]+", value), (what, value)
        else:
            assert re.match(r"\d+(\.\d+)? \S", value), (section, what, value)
    names = {(r[0], r[1]): r for r in rows}
    assert "PyAV no, gguf no" in names[("env", "software")][3]
    # The trace section: on the CPU the real run's live tensor bytes are what the fake-tensor
    # trace of the same job counts, phase by phase, within 2 % (the weights included; the
    # CPU's attention kernel at these tiny shapes is not quite the fused one the trace models).
    traced = [r for r in rows if r[0] == "trace"]
    assert len(traced) == 3 * len(gpu_checks.TRACE_CELLS)
    units = {"MiB": 2 ** 20, "GiB": 2 ** 30}
    size = lambda text: float(text.split()[0]) * units[text.split()[1]]  # noqa: E731
    for _, what, value, note in traced:
        live = size(value.removesuffix(" live tensor bytes (CPU: no allocator)"))
        trace = size(re.match(r"trace (\S+ \S+) \(weights ", note).group(1))
        assert abs(trace - live) <= 0.02 * live, (what, value, note)
    kernel = next(r for r in rows if r[1].startswith("attention kernel"))
    assert kernel[2] == "flash" and "_scaled_dot_product_flash_attention_for_cpu" in kernel[3]
    for needed in ("steady state (second run)", "4 of 4 blocks swapped",
                   "decode 1080p stand-in 32x48 x 5, cudnn.benchmark on, channels_last_3d on",
                   "host syncs, 7B forward", "host syncs, decode", "Q4_K -> float32",
                   "float8_e4m3fn -> float32"):
        assert any(needed in what for _, what, _, _ in rows), needed
    if kitchen:  # a measured row per format and compute_precision, each on its own path
        for target in gpu_checks.LOWP_FORMATS:
            for precision, path in (("weights", "weights"), ("auto", PATH_OF[target])):
                stand_in = ", capability 12.0 stand-in" if precision == "auto" else ""
                row = names[("lowp", f"3B forward 1080p stand-in 32x48 x 5, {target}, "
                                     f"compute_precision={precision}{stand_in}")]
                assert f"packed linears by path: 30 {path}" in row[3], row
    # vae_paths: one line per path, today's bit-identical to itself; where the kitchen runs,
    # the fused norm and the int8 tails change the bits (finite PSNR), the eager backend's
    # fp16_conv3d is torch's conv (inf on the CPU).
    lines = [line for line in result.stdout.splitlines() if line.startswith("vae_paths ")]
    pattern = r"vae_paths (\w+): time [\d.]+ s, peak [\d.e-]+ GiB, PSNR (inf|[\d.]+) dB vs today"
    found = [re.fullmatch(pattern, line) for line in lines]
    assert all(found) and [m[1] for m in found] == list(gpu_checks.VAE_PATHS), lines
    psnr = {m[1]: m[2] for m in found}
    assert psnr["today"] == "inf"
    if kitchen:
        assert psnr["fused_norm"] != "inf" and psnr["int8_cache"] != "inf", lines
        assert float(psnr["int8_cache"]) > 40 and float(psnr["fused_norm"]) > 50, lines
    steady = next(r for r in rows if "steady state" in r[1])
    assert re.search(r"per phase: encode [\d.]+ s, dit [\d.]+ s, decode [\d.]+ s", steady[3])


PATH_OF = {"int8": "int8", "int8_convrot": "int8", "fp8_e4m3fn": "fp8", "mxfp8": "mxfp8",
           "nvfp4": "nvfp4"}


# Per rehearsed compute capability, the layers of the tiny 3B (30 packed linears) each format
# computes on its kernel: int8 from 7.5 (comfy-kitchen's int8_linear), fp8 from 8.9
# (torch._scaled_mm), mxfp8 and nvfp4 from 10.0.
ON_THE_KERNEL = {"int8": (7, 5), "int8_convrot": (7, 5), "fp8": (8, 9), "mxfp8": (10, 0),
                 "nvfp4": (10, 0)}
REHEARSED = ((7, 5), (8, 0), (8, 9), (10, 0), (12, 0))


def test_lowp_rehearsal_at_each_capability_prints_what_runs_where(tmp_path, monkeypatch, capsys):
    """``--sections lowp --capability ...``: the lowp section on the CPU through the paths a
    GPU of each capability takes, every kernel call checked against its preconditions and every
    layer's product against its definition: one line per format and capability, failed 0."""
    pytest.importorskip("comfy_kitchen", reason="comfy-kitchen not installed")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_checks.main(["--rehearse", "--sections", "lowp", "--capability",
                            ",".join(f"{a}.{b}" for a, b in REHEARSED)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lowp ")]
    expected = []
    for fmt, needs in ON_THE_KERNEL.items():
        for major, minor in REHEARSED:
            kernel = 30 if (major, minor) >= needs else 0
            expected.append(f"lowp {fmt} capability {major}.{minor}: {kernel} layers on the "
                            f"kernel, {30 - kernel} dequantised, failed 0")
    assert [line.split(" (relative")[0] for line in lines] == expected
    assert all(re.search(r"\(relative L2 difference from bf16 \d\.\d\de-0[1-3]\)$", line)
               for line in lines if not line.startswith("lowp int8 ")), lines
    rows = _rows((tmp_path / "gpu_checks.md").read_text())
    assert [r for r in rows if r[2] in ("error", "skipped")] == []


def test_lowp_without_comfy_kitchen_says_how_to_get_it(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['comfy_kitchen'] = None\n")
    result = _run("--rehearse", "--sections", "lowp",
                  env={"OUT": str(tmp_path / "out"), "PYTHONPATH": str(blocker)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert _rows(result.stdout) == [("lowp", "(section)", "skipped", gpu_checks.KITCHEN_WHEEL)]


def test_a_section_past_its_cap_is_stopped_and_the_rows_so_far_kept(tmp_path, monkeypatch):
    def slow(run):
        run.report.add("env", "first row", "1 s")
        time.sleep(30)  # interrupted by the section's cap
        run.report.add("env", "never", "1 s")

    monkeypatch.setattr(gpu_checks, "CHECKS", dict(
        gpu_checks.CHECKS, env=slow,
        e2e=lambda run: run.report.add("e2e", "after", "2 s")))
    monkeypatch.setattr(gpu_checks, "REHEARSE_CAP", 1)
    monkeypatch.setattr(gpu_checks, "MIN_SECTION_SECONDS", 0.5)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_checks.main(["--rehearse", "--sections", "e2e,env"]) == 0
    rows = _rows((tmp_path / "gpu_checks.md").read_text())
    assert rows == [("env", "first row", "1 s", ""),
                    ("env", "(rest of the section)", "skipped", "stopped at its 1 s cap"),
                    ("e2e", "after", "2 s", "")]  # sections run in order of value


@pytest.mark.parametrize("args, message", [
    (["--rehearse", "--sections", "mfu,bogus"],
     "--sections 'mfu,bogus': unknown section(s) bogus; choose from env, e2e, trace, mfu, "
     "blockswap, vae, dequant, room, lowp, vae_paths"),
    (["--rehearse", "--sections", ","], "--sections ',': unknown section(s) (none given); "
     "choose from env, e2e, trace, mfu, blockswap, vae, dequant, room, lowp, vae_paths"),
    (["--rehearse", "--minutes", "0"], "--minutes 0.0: give a time between 0 and 60 minutes"),
    (["--rehearse", "--capability", "8.9,sm90"], "--capability '8.9,sm90': give compute "
     "capabilities as X.Y, comma-separated (e.g. 7.5,8.9,12.0)"),
])
def test_bad_arguments_are_named(args, message, capsys):
    assert gpu_checks.main(args) == 2
    assert capsys.readouterr().err == f"gpu_checks: {message}\n"


def test_unknown_flags_are_named(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_checks.main(["--rehearse", "--frobnicate"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_real_run_says_to_use_rehearse(capsys):
    assert gpu_checks.main(["--sections", "env"]) == 2
    assert capsys.readouterr().err == (
        "gpu_checks: no CUDA device here: these checks measure a GPU. Use --rehearse to run "
        "every section on the CPU at small sizes\n")


# -- the CUDA-only readings, on traces shaped like CUDA ones -----------------------------------

@pytest.mark.parametrize("name, family", [
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, "
     "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, "
     "false, false, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
     "flash"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
     "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
     "mem-efficient"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
     "cuDNN attention"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
     "flash::CollectiveMainloopFwdSm90<2, cute::tuple<>, false> > > >(...)", "FlashAttention-3"),
    ("flash_attn_3::fwd", "FlashAttention-3"),
    ("aten::_scaled_dot_product_attention_math", "math"),
    ("aten::_scaled_dot_product_efficient_attention", "mem-efficient"),
    ("aten::_scaled_dot_product_cudnn_attention", "cuDNN attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "flash"),
    ("aten::scaled_dot_product_attention", None),  # the dispatcher, not a kernel
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", None),
])
def test_attention_kernels_are_named_by_family(name, family):
    assert gpu_checks._attention_family(name) == family


def test_copy_overlap_counts_copy_time_under_kernels(monkeypatch):
    from types import SimpleNamespace as Event

    cuda = torch.autograd.DeviceType.CUDA

    def event(name, start, end):  # microseconds, as the profiler's time ranges
        return Event(name=name, device_type=cuda, time_range=Event(start=start, end=end))

    trace = Event(events=lambda: [
        event("gemm", 0, 100), event("softmax", 90, 150),  # kernels cover [0, 150)
        event("Memcpy HtoD (Pinned -> Device)", 50, 250),  # 100 of 200 us under kernels
        event("Memcpy HtoD (Pinned -> Device)", 300, 400),  # none
        event("Memset (Device)", 250, 450),  # neither a kernel nor a copy
    ])
    seconds, share = gpu_checks.copy_overlap(trace)
    assert seconds == pytest.approx(300e-6) and share == pytest.approx(100 / 300)


def test_a_failed_kernel_check_is_an_error_row_not_the_end_of_the_run():
    """A kernel check is a BaseException, so the code under test cannot swallow it; the table
    keeps it as that row's error (the full-size fake-CUDA rehearsal's vae_paths section ended
    the whole run on one)."""
    from kernel_checks import KernelCheckFailed

    def refused():
        raise KernelCheckFailed("head dimension 512 is over 256")

    report = gpu_checks.Report()
    gpu_checks.measure(report, "vae_paths", "today", refused)
    assert [row[1:3] for row in report.rows] == [("today", "error")]
    assert "KernelCheckFailed: head dimension 512" in report.rows[0][3]


def test_blockswap_rows_weigh_each_swapped_block_as_it_is():
    """The 3B's blocks differ in size (its video-only blocks are half the others): counted as
    the largest times the number swapped, the fake rehearsal's row for 32 of 32 swapped read
    "resident weights + 2 blocks = -2.55 GiB" and 9.46 GiB copied per forward of a 6.32 GiB
    model."""
    from seedvr2.models import build_on_meta
    from seedvr2.models.config import dit_config

    dit = build_on_meta("dit", dit_config("3b")).to(torch.bfloat16)
    sizes = [gpu_checks.tensor_bytes(b) for b in dit.blocks]
    total = gpu_checks.tensor_bytes(dit)
    assert len(set(sizes)) > 1
    resident, moved = gpu_checks.swap_bytes(dit, len(sizes))
    assert moved == sum(sizes) < total
    assert resident == total - sum(sizes) + sum(sorted(sizes)[-2:])


def test_a_fake_rows_numbers_of_data_read_na_with_their_brackets_kept():
    """The blockswap row's value "12.3 ms (1.50x)" read "n/a (fake) (n/a (fake)" on the fake
    GPU: the ratio's closing bracket went with the NaN."""
    report = gpu_checks.Report(fake=True)
    report.add("blockswap", "row", f"{float('nan'):.1f} ms ({float('nan'):.2f}x)",
               f"{float('nan'):.1f} GB/s, {float('nan'):.0%} overlapping")
    assert report.rows[-1][2:] == ("n/a (fake) (n/a (fake))",
                                   "n/a (fake), n/a (fake) overlapping")
