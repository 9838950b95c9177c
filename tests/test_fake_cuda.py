"""The GPU run's own branch on a fake ``cuda:0`` (tests/fake_cuda.py, issue 42): the stand-in
answers as a GPU of its capability and refuses what one would; bench/gpu_checks.py's sections
on it (tiny models: the real sizes are ``bench/gpu_checks.sh --rehearse --fake-cuda``) take the
kernels the capability has, with no fallback; and the first-run defects a read of the CUDA
branch found stay fixed."""

from __future__ import annotations

import contextlib
import gc
import re
import signal
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import gpu_checks  # noqa: E402
from fake_cuda import fake_cuda  # noqa: E402

from seedvr2.memory import budget as mem  # noqa: E402

CUDA = torch.device("cuda", 0)


@contextlib.contextmanager
def fake_run(capability, report=None):
    """A gpu_checks Run on a fake GPU of ``capability`` with the tiny models."""
    with fake_cuda(capability) as gpu:
        report = report or gpu_checks.Report(fake=True)
        yield gpu_checks.Run(CUDA, gpu_checks.rehearse_scale(), report, (capability,), fake=gpu)


# -- the stand-in ----------------------------------------------------------------------------------

def test_the_stand_in_answers_as_its_gpu_and_logs_work_in_issue_order():
    with fake_cuda((9, 0)) as gpu:
        assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        assert torch.cuda.get_device_name(CUDA) == "NVIDIA H100 80GB HBM3"
        x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_allocated() == 1 << 20
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            host = torch.zeros(256, dtype=torch.uint8).pin_memory()
            y = host.to(CUDA, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        torch.cuda.current_stream().wait_event(done)
        (y + x[:256]).sum()
        assert torch.cuda.max_memory_allocated() == (1 << 20) + 2 * 256 + 8  # + the sum
    kinds = [(op.kind, op.stream) for op in gpu.log if op.kind != "pin"]
    assert kinds[:3] == [("copy", side.name), ("record", side.name), ("wait_event", "default")]
    assert gpu.log[1].detail == "cpu->cuda:0 pinned non_blocking 256 B"
    assert gpu.violations == []


@pytest.mark.parametrize("capability, dtype, refused", [
    ((7, 5), torch.bfloat16, True), ((8, 0), torch.bfloat16, False),
    ((8, 0), torch.float16, False)])
def test_a_product_in_a_dtype_the_capability_lacks_is_a_violation(capability, dtype, refused):
    with fake_cuda(capability) as gpu:
        x = torch.randn(8, 8, device="cuda", dtype=dtype)
        x @ x
    assert bool(gpu.violations) == refused, gpu.violations
    if refused:
        assert gpu.violations == ["mm.default in bfloat16 on capability 7.5, which lacks it"]


def test_cpu_work_in_a_cuda_branch_is_a_violation():
    with fake_cuda((9, 0)) as gpu:
        x = torch.randn(8, 8, device="cuda")
        h = torch.randn(8, 8)  # a host tensor meeting a CUDA one: raises, as on a GPU
        with pytest.raises(RuntimeError, match="two different devices|same device"):
            x @ h
        with gpu.on_device():
            h @ h  # a CPU-only branch taken inside a CUDA one
    assert len(gpu.violations) == 2, gpu.violations
    assert gpu.violations[0].startswith("mm.default: ")
    assert gpu.violations[1] == "mm.default computed on the CPU inside a CUDA branch"


# -- first-run defects (issue 42, section 2) -------------------------------------------------------

def test_cached_memory_split_by_smaller_tensors_is_not_counted_free():
    """Item 3: what the allocator caches in split blocks cannot hold one large tensor (the
    fake's allocator keeps every freed byte as such a block: the worst case)."""
    with fake_cuda((9, 0)):
        big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        small = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        del big
        gc.collect()
        free, _ = torch.cuda.mem_get_info()
        assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() == 1 << 30
        assert mem.device_available(CUDA) == free
        assert mem.device_available(CUDA, own_bytes=5) == free + 5
        del small


def test_random_models_are_made_in_their_dtype_on_the_device():
    """Item 3: no float32 copy of the weights on the device (it would leave the allocator's
    cache split): the peak is the bf16 weights' bytes, below the 2x a float32 copy adds."""
    with fake_cuda((9, 0)):
        vae = gpu_checks.random_model(gpu_checks.build_vae, gpu_checks.rehearse_scale().vae, CUDA,
                                      torch.bfloat16)
        weights = gpu_checks.tensor_bytes(vae)
        assert {p.dtype for p in vae.parameters()} == {torch.bfloat16}
        assert {p.device for p in vae.parameters()} == {CUDA}
        assert torch.cuda.max_memory_allocated() < 2 * weights


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA GeForce RTX 5090", None)])
def test_mfu_peaks_are_the_products_own(name, peak):
    """Item 12: an H100 PCIe board peaks at 756 TFLOP/s bf16, not the SXM's 989."""
    assert gpu_checks.bf16_peak(name) == peak


def test_the_default_sections_leave_each_its_slack():
    """Item 11: the alarm fires between Python steps only, so a section can overrun its cap by
    a running kernel's time: with each default section overrunning by SLACK, every one still
    prints its rows within the 8-minute default."""
    assert sum(gpu_checks.CAPS[s] for s in gpu_checks.DEFAULT_SECTIONS) <= 420
    assert sum(gpu_checks.CAPS[s] + gpu_checks.SLACK for s in gpu_checks.DEFAULT_SECTIONS) <= 480


def test_every_default_section_prints_its_rows_when_each_overruns_by_its_slack(monkeypatch):
    """Item 11, run: time scaled down 50x (about 10 s); each section adds its row, runs to its
    cap, then holds the alarm off for its slack (as a kernel still running does)."""
    scale = 1 / 50

    def overrunning(name):
        def section(run):
            run.report.add(name, "row", "1")
            try:
                time.sleep(1)  # interrupted by the section's alarm
            finally:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
                time.sleep(gpu_checks.SLACK * scale)  # the kernel the alarm waits for
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
        return section

    caps = {s: c * scale for s, c in gpu_checks.CAPS.items()}
    monkeypatch.setattr(gpu_checks, "CHECKS", {s: overrunning(s) for s in gpu_checks.SECTIONS})
    monkeypatch.setattr(gpu_checks, "MIN_SECTION_SECONDS", gpu_checks.MIN_SECTION_SECONDS * scale)
    report = gpu_checks.Report()
    run = gpu_checks.Run(torch.device("cpu"), gpu_checks.rehearse_scale(), report)
    monkeypatch.setattr(run, "free", lambda: None)  # (a collection per section: not scaled)
    args = SimpleNamespace(sections=list(gpu_checks.DEFAULT_SECTIONS), minutes=8 * scale)
    gpu_checks.run_sections(run, args, caps)
    printed = [section for section, what, _, _ in report.rows if what == "row"]
    assert printed == list(gpu_checks.DEFAULT_SECTIONS), report.rows


def test_vae_paths_keep_each_decoded_video_on_the_host(monkeypatch):
    """Item 10: every row runs today's path here, so every row's peak must be the same; a
    decoded video kept on the GPU would add to each later row's."""
    from seedvr2.models.vae_paths import TODAY

    monkeypatch.setattr(gpu_checks, "_vae_path_table",
                        lambda run: dict.fromkeys(gpu_checks.VAE_PATHS, TODAY))
    with fake_run((9, 0)) as run:
        gpu_checks.check_vae_paths(run)
        assert run.fake.violations == []
    peaks = [re.search(r"peak (\S+) GiB", line)[1] for line in run.lines]
    assert len(peaks) == len(gpu_checks.VAE_PATHS) and len(set(peaks)) == 1, run.lines
    assert all(line.endswith("PSNR n/a (fake) vs today") for line in run.lines), run.lines


def test_pinned_host_memory_is_made_without_the_driver():
    """Pinned staging buffers (``memory.arena.PinnedStaging``: pageable host memory copied to
    the GPU a piece at a time) are made with ``torch.empty(pin_memory=True)``, which asked the
    real CUDA driver: the full-size rehearsal's trace section stopped on "Found no NVIDIA
    driver"."""
    from seedvr2.memory.arena import PinnedStaging

    with fake_cuda() as gpu:
        made = torch.empty(64, dtype=torch.uint8, pin_memory=True)
        assert made.is_pinned() and not torch.empty(8).is_pinned()
        assert PinnedStaging().allocate(1024).is_pinned()
    assert [op.kind for op in gpu.log if op.kind == "pin"] == ["pin", "pin"]


def test_the_vae_attention_may_take_the_math_kernel_on_a_gpu():
    """The VAE's mid-block attention is one head of 512 channels: the fused kernels refuse it
    and PyTorch's math kernel runs it (the VAE splits its scores for that). The vae_paths
    section's kernel checks on a GPU stopped the full-size fake-CUDA rehearsal there
    (2026-12-07), as they would have stopped a real GPU's run."""
    with fake_run((9, 0)) as run, gpu_checks.vae_stand_in(run, (9, 0)):
        q = torch.empty(2, 1, 64, 512, device="cuda", dtype=torch.float16)
        assert F.scaled_dot_product_attention(q, q, q).shape == q.shape


# -- the lowp section on the fake GPU --------------------------------------------------------------

TINY_LAYERS = 30  # the tiny 3B's packed linears


def _lowp_lines(capability):
    """The lowp section as the fake-CUDA rehearsal runs it: (its lines, passed, rows)."""
    with fake_run(capability) as run:
        args = SimpleNamespace(sections=["lowp"], minutes=15)
        ok = gpu_checks.run_sections(run, args, {"lowp": gpu_checks.FAKE_CUDA_CAP})
    return [line.split(" (relative")[0] for line in run.lines], ok, run.report.rows


LOWP_LINES = {"int8": "int8", "int8_convrot": "int8_convrot", "fp8_e4m3fn": "fp8",
              "mxfp8": "mxfp8", "nvfp4": "nvfp4"}


@pytest.mark.parametrize("capability, formats, kernels", [
    # (9.0: int8's dispatch is int8_convrot's without the rotation, run at 10.0 below)
    ((9, 0), ("int8_convrot", "fp8_e4m3fn", "mxfp8"), ("int8_convrot", "fp8")),
    ((10, 0), tuple(LOWP_LINES), ("int8", "int8_convrot", "fp8", "mxfp8", "nvfp4"))])
def test_lowp_layers_run_on_the_kernels_the_capability_has(capability, formats, kernels,
                                                           monkeypatch):
    """Section 1's end state on the tiny 3B: on 9.0 int8, int8_convrot and fp8 layers on the
    kernel, on 10.0 mxfp8 and nvfp4 too; no fallback, failed 0, rows marked (fake cuda)."""
    pytest.importorskip("comfy_kitchen")
    monkeypatch.setattr(gpu_checks, "LOWP_FORMATS", formats)
    lines, ok, rows = _lowp_lines(capability)
    major, minor = capability
    expected = []
    for fmt in (LOWP_LINES[f] for f in formats):
        on = TINY_LAYERS if fmt in kernels else 0
        expected.append(f"lowp {fmt} capability {major}.{minor}: {on} layers on the kernel, "
                        f"{TINY_LAYERS - on} dequantised, failed 0")
    assert lines == expected
    assert ok, rows[-1]
    assert all(what.endswith(" (fake cuda)") for _, what, _, _ in rows)
    assert rows[-1][1:3] == ("checks (fake cuda)", "passed")


def test_a_hadamard_built_on_the_cpu_fails_the_run(monkeypatch):
    """A deliberate mistake: the int8_convrot Hadamard made on the CPU in a CUDA branch."""
    pytest.importorskip("comfy_kitchen")
    from seedvr2.loading import int8

    made = int8.regular_hadamard
    monkeypatch.setattr(int8, "regular_hadamard",
                        lambda size, device=None, dtype=torch.float32: made(size, dtype=dtype))
    monkeypatch.setattr(gpu_checks, "LOWP_FORMATS", ("int8_convrot",))
    lines, ok, rows = _lowp_lines((9, 0))
    assert not ok
    assert rows[-1][2] == "FAILED" and "device" in rows[-1][3], rows[-1]


def test_an_empty_quantiser_log_on_cuda_fails_the_run(monkeypatch):
    """A deliberate mistake, the harness as it was: on CUDA only the products are wrapped, the
    quantisers' calls go unrecorded, every fp8 product's check raises and the layer falls
    back to dequantised weights."""
    pytest.importorskip("comfy_kitchen")
    from kernel_checks import checked_products

    monkeypatch.setattr(gpu_checks, "lowp_stand_in",
                        lambda run, capability: checked_products(compare=False))
    monkeypatch.setattr(gpu_checks, "LOWP_FORMATS", ("fp8_e4m3fn",))
    lines, ok, rows = _lowp_lines((9, 0))
    assert lines == [f"lowp fp8 capability 9.0: 0 layers on the kernel, {TINY_LAYERS} "
                     f"dequantised, failed {TINY_LAYERS}"]
    assert not ok and rows[-1][2] == "FAILED"
    assert "where 30 layers have a kernel (first failure: ValueError: not enough values to " \
        "unpack" in rows[-1][3], rows[-1]


# -- the pipeline's own CUDA branches --------------------------------------------------------------

MEMORY_SETTINGS = {
    "defaults": {},
    "offload": dict(dit_offload_device="cpu", vae_offload_device="cpu"),
    "blockswap": dict(dit_offload_device="cpu", blocks_to_swap=2),
    "int8 VAE cache, host": dict(vae_int8_cache="host"),
    # 2 x 2 tiles (one tile has no blend weights: the weights' move to the GPU went untested,
    # and under inference mode it reached the real driver in the full-size rehearsal)
    "VAE tiles": dict(resolution=128, vae_encode_tiled=True, vae_decode_tiled=True,
                      vae_encode_tile_size=64, vae_decode_tile_size=64,
                      vae_encode_tile_overlap=16, vae_decode_tile_overlap=16),
}


@pytest.mark.parametrize("setting", MEMORY_SETTINGS)
def test_a_tiny_job_takes_the_cuda_branch_of_each_memory_setting(setting, tiny_options):
    """One tiny job per memory setting on a fake 9.0 GPU: placement, offloading, BlockSwap's
    prefetch and pinned copies run as on a GPU; nothing meets a tensor on the wrong device, and
    every copy a side stream makes is ordered: the side stream waits for the compute stream
    before it, and the compute stream waits for the copy's event before using it."""
    import seedvr2

    clip = torch.rand(5, 16, 16, 3)
    options = {**tiny_options, "device": "cuda:0", "dtype": "bf16", "resolution": 32,
               "batch_size": 5, **MEMORY_SETTINGS[setting]}
    with fake_cuda((9, 0)) as gpu:
        out = seedvr2.upscale(clip, **options)
        side = options["resolution"]
        assert out.shape == (5, side, side, 3) and out.device.type == "cpu"
    assert gpu.violations == []
    log = [op for op in gpu.log if op.kind != "op"]
    side = {op.stream for op in log if op.kind == "copy"} - {"default"}
    assert bool(side) == (setting == "blockswap"), side
    for i, op in enumerate(log):
        if op.kind == "copy" and op.stream in side:
            before = [o for o in log[:i] if o.stream == op.stream]
            assert before and before[-1].kind in ("wait_event", "copy"), log[max(0, i - 3):i + 1]
            recorded = next(o for o in log[i:] if o.stream == op.stream and o.kind == "record")
            assert any(o.kind == "wait_event" and o.detail == recorded.detail and
                       o.stream == "default" for o in log[i:]), recorded
    uploads = [op for op in log if op.kind == "copy" and op.detail.startswith("cpu->cuda")]
    assert uploads and all("pinned non_blocking" in op.detail or "blocking" in op.detail
                           for op in uploads)
    # The VAE in bf16 on a GPU with comfy-kitchen's CUDA backend takes the fused norm (its GPU
    # branch; the fake answered "backend not loaded" and the branch never ran here).
    assert any("group_norm_silu_pad3d" in op.detail for op in gpu.log), \
        {op.detail for op in gpu.log if "norm" in op.detail}


def test_the_budget_weighs_a_model_on_the_fake_gpu_as_on_the_cpu():
    """A fake tensor's address reads 0, and the budget told tensors apart by address: it took
    a model on the fake GPU for one tensor per size, so the full-size rehearsal's budget rows
    read 6.8 GiB low (e2e decode: 36.16 GiB traced against a 35.12 GiB budget)."""
    from dataclasses import replace

    from seedvr2.models import build_vae
    from seedvr2.models.config import vae_config

    config = replace(vae_config("vae"), block_out_channels=(32, 32, 64, 64))
    on_cpu = build_vae(config)
    expected = sum(t.numel() * t.element_size() for t in on_cpu.state_dict().values())
    assert mem.Weights.of_module(on_cpu).total == expected
    with fake_cuda((9, 0)):
        on_gpu = build_vae(config).to("cuda")
        assert mem.Weights.of_module(on_gpu).total == expected
        assert mem.bytes_on(on_gpu, torch.device("cuda:0")) == expected


def test_the_mfu_rows_on_the_fake_gpu_say_what_it_cannot_see_and_count_its_reads():
    """The profiler sees none of a fake tensor's operations: on the fake GPU the mfu section's
    rows read "none found" (attention kernel) and "0 stream syncs" whatever the forward did.
    Host reads now come from the fake GPU's log; the kernel SDPA picks is torch's choice on
    the CUDA runtime, which the fake has not: "n/a (fake)"."""
    with fake_run((9, 0)) as run:
        q = torch.empty(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)

        def forward():
            out = F.scaled_dot_product_attention(q, q, q)
            torch.empty(3, device="cuda").isnan().any().item()  # (a check read back)
            return out
        family, _ = gpu_checks.attention_kernel(run, forward)
        reads, note = gpu_checks.host_syncs(run, forward)
    assert family == gpu_checks.FAKE_NUMBER
    assert (reads, note) == ("1 host reads",
                             "device->host reads in the fake GPU's log (_local_scalar_dense x1)")


def test_models_passed_in_run_as_placed_as_their_files_would_be(tiny_options):
    """Modules passed in (the CLI loads its models once and passes them to each input's job; a
    library caller may load its own) were placed again per job with plain offloading: the
    BlockSwap asked for, or attached at their load, was dropped or stacked under a second host
    copy, and on the GPU every DiT block sat there at once (3B on a fake 8 GiB card, fitted to
    blocks_to_swap 7: the DiT phase at 7.86 GiB). Now each runs with the DiT phase's peak of the
    same job given the files, a second job reusing the placement."""
    import seedvr2
    from seedvr2.api import load_models
    from seedvr2.loading import load_dit
    from seedvr2.options import resolve_options
    from seedvr2.pipeline.runner import JobStats

    clip = torch.rand(5, 16, 16, 3)
    given = dict(tiny_options, device="cuda:0", dtype="bf16", resolution=32, batch_size=5,
                 dit_offload_device="cpu", blocks_to_swap=4)
    dit_file, vae_file, model_dir = (given.pop(k) for k in ("dit", "vae", "model_dir"))
    opts = resolve_options(**given)

    def dit_peak(dit, vae):
        stats = JobStats()
        seedvr2.upscale(clip, dit, vae, model_dir=model_dir, opts=opts, stats=stats)
        return stats.phases["dit"].device_allocated
    with fake_cuda((9, 0)):
        from_files = dit_peak(dit_file, vae_file)
        loaded = load_models(dit_file, vae_file, opts=opts, model_dir=model_dir)
        passed_back = [dit_peak(loaded.dit, loaded.vae) for _ in range(2)]
        del loaded  # (its VAE stays on the GPU while it lives)
        gc.collect()
        own = load_dit(str(dit_file), torch.bfloat16, "cpu")
        own_module = [dit_peak(own, vae_file) for _ in range(2)]
        block = min(sum(t.numel() * t.element_size() for t in b.parameters())
                    for b in own.blocks)  # (a block resident beyond BlockSwap's own shows)
        del own
        gc.collect()  # (host copies unpinned while the fake GPU answers)
    assert passed_back[0] == passed_back[1] and own_module[0] == own_module[1]
    assert all(abs(peak - from_files) < block // 4 for peak in passed_back + own_module), \
        (from_files, passed_back, own_module, block)


def test_a_swapped_dit_waits_off_the_gpu_until_its_phase(tiny_options, monkeypatch):
    """BlockSwap brought the DiT's resident weights to the GPU when the model loaded, so they
    sat there through the first encode, which the budget plans without them (3B on a fake
    8 GiB card: the first encode at 6.08 GiB against 1.84 for the others)."""
    import seedvr2
    from seedvr2.pipeline.runner import Upscaler

    seen = []
    encode = Upscaler._encode

    def counted(self, *args, **kwargs):
        seen.append(sum(t.numel() * t.element_size() for t in self.models.dit.parameters()
                        if t.device.type == "cuda"))
        return encode(self, *args, **kwargs)
    monkeypatch.setattr(Upscaler, "_encode", counted)
    options = dict(tiny_options, device="cuda:0", dtype="bf16", resolution=32, batch_size=5,
                   dit_offload_device="cpu", blocks_to_swap=2)
    with fake_cuda((9, 0)):
        seedvr2.upscale(torch.rand(9, 16, 16, 3), **options)
        gc.collect()
    assert seen == [0, 0]
