"""CUDA-only decisions checked on the CPU: the dtype ``auto`` picks for a GPU generation, the
fp16 overflow guard, compile/attention fallbacks under out-of-memory errors, refused CUDA-graph
compile modes, and the budget's CUDA margins."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

from seedvr2.memory import budget as mem
from seedvr2.memory.budget import GIB, Budget, BudgetError, BatchShape, Placement, Weights
from seedvr2.memory.compile import CompileSettings, apply_compile, is_out_of_memory
from seedvr2.memory.device_choice import NonFiniteError, check_finite, resolve_dtype
from seedvr2.options import OptionError

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("capability, expected", [
    ((6, 1), torch.float16),  # Pascal
    ((7, 0), torch.float16),  # V100
    ((7, 5), torch.float16),  # T4, RTX 20xx: is_bf16_supported() says yes (emulated)
    ((8, 0), torch.bfloat16),  # A100
    ((8, 9), torch.bfloat16),
    ((9, 0), torch.bfloat16),  # H100
])
def test_auto_dtype_follows_native_bf16_not_emulation(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", CUDA) == expected
    assert resolve_dtype("bf16", CUDA) == torch.bfloat16  # an explicit choice is kept
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("arch, capability, expected", [
    ("gfx803", (8, 0), torch.float16),  # Polaris: ROCm's 8.0 is no Ampere
    ("gfx906:sramecc+:xnack-", (9, 0), torch.float16),  # MI50, Radeon VII: no bf16 matrices
    ("gfx1030", (10, 3), torch.float16),  # RDNA2
    ("gfx908:sramecc+:xnack-", (9, 0), torch.bfloat16),  # MI100
    ("gfx90a:sramecc+:xnack-", (9, 0), torch.bfloat16),  # MI200
    ("gfx942:sramecc+:xnack-", (9, 4), torch.bfloat16),  # MI300
    ("gfx1100", (11, 0), torch.bfloat16),  # RDNA3
    ("gfx1201", (12, 0), torch.bfloat16),  # RDNA4
])
def test_auto_dtype_on_amd_follows_the_gfx_architecture(monkeypatch, arch, capability, expected):
    """ROCm reports gfx numbers as the capability (gfx906 says 9.0), not NVIDIA's: bf16 is
    native where the architecture has bf16 matrix instructions."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(gcnArchName=arch))
    assert resolve_dtype("auto", CUDA) == expected


def test_fp16_overflow_is_reported_with_the_setting_to_change():
    fine = torch.tensor([1.0, 65504.0], dtype=torch.float16)
    check_finite(fine, "DiT", torch.float16)
    overflow = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    with pytest.raises(NonFiniteError, match=r"the DiT produced NaN or infinite values in fp16 "
                                             r".*set dtype to fp32 \(--dtype fp32"):
        check_finite(overflow, "DiT", torch.float16)
    # Every dtype is checked (a weight of extreme magnitude overflows bf16 and fp32 too), the
    # batch named.
    with pytest.raises(NonFiniteError, match=r"^the DiT produced NaN or infinite values in "
                                             r"float32: .*extreme magnitude.*; stopped at batch "
                                             r"3 \(frames 12 to 20\)$"):
        check_finite(overflow.float(), "DiT", torch.float32, "batch 3 (frames 12 to 20)")


def test_pipeline_stops_on_non_finite_values_in_any_dtype_naming_the_batch(tiny_options,
                                                                            monkeypatch):
    """Each batch's latent, DiT output and decoded frames are checked in every dtype (a bf16 or
    fp32 job of a weight file with extreme scales writes black frames otherwise): the job stops
    naming the phase, the batch and the likely cause."""
    import seedvr2
    from seedvr2.pipeline import runner

    real = runner.tiling.encode_posterior
    calls = []

    def poisoned(*args, **kwargs):
        mean, logvar = real(*args, **kwargs)
        calls.append(1)
        return (mean * float("nan") if len(calls) == 2 else mean), logvar
    monkeypatch.setattr(runner.tiling, "encode_posterior", poisoned)
    with pytest.raises(NonFiniteError, match=r"^the VAE encoder produced NaN or infinite values "
                                             r"in float32: .*; stopped at batch 1 \(frames 5 to "
                                             r"9\)$"):
        seedvr2.upscale(torch.rand(10, 16, 24, 3), **tiny_options, resolution=32, batch_size=5,
                        scene_cuts="off",
                        text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))


def test_pipeline_stops_on_non_finite_dit_output_in_fp16(tiny_options, monkeypatch):
    """The runner checks the DiT's output: an fp16 run whose DiT overflows stops with the
    message instead of writing garbage frames."""
    import seedvr2
    from seedvr2.models.dit import NaDiT

    real = NaDiT.forward
    monkeypatch.setattr(NaDiT, "forward", lambda self, *a: real(self, *a) * float("inf"))
    with pytest.raises(NonFiniteError, match="the DiT produced NaN or infinite values in fp16"):
        seedvr2.upscale(torch.rand(5, 16, 24, 3), **{**tiny_options, "dtype": "fp16"},
                        resolution=32, batch_size=5,
                        text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))


# -- torch.compile and attention backends under out-of-memory -----------------------------------


def _oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_is_found_inside_wrapped_errors():
    class Wrapped(RuntimeError):
        def __init__(self, inner):
            super().__init__("backend compiler failed")
            self.inner_exception = inner
    assert is_out_of_memory(_oom())
    assert is_out_of_memory(Wrapped(_oom()))
    try:
        try:
            raise _oom()
        except torch.OutOfMemoryError as e:
            raise RuntimeError("while autotuning") from e
    except RuntimeError as chained:
        assert is_out_of_memory(chained)
    assert not is_out_of_memory(RuntimeError("no compiler here"))


def test_compile_reraises_out_of_memory_and_keeps_the_compiled_path(monkeypatch):
    calls = []

    def compiled_raising_oom(fn, **kwargs):
        def run(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise _oom()
            return fn(*a, **k)
        return run

    monkeypatch.setattr(torch, "compile", compiled_raising_oom)
    vae = torch.nn.Module()
    vae.encoder, vae.decoder = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    apply_compile(None, vae, CompileSettings(backend="inductor"))
    x = torch.rand(2, 4)
    with pytest.raises(torch.OutOfMemoryError):
        vae.encoder(x)
    assert vae.encoder._compile_failed is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no eager fallback warning
        vae.encoder(x)
    assert len(calls) == 2  # the second call went through the compiled path again


def test_attention_backend_keeps_its_kernel_after_out_of_memory(monkeypatch):
    from seedvr2.models import attention

    attn = attention.WindowAttention(8, 2, 4, 1e-6, False, rope=torch.nn.Identity())
    attn.backend = "flash_attn_2"
    monkeypatch.setattr(attention, "attend", lambda q, k, v, backend="sdpa": (_ for _ in ()).throw(_oom()))
    q = torch.rand(1, 3, 2, 4)
    with pytest.raises(torch.OutOfMemoryError):
        attn._attend(q, q, q)
    assert attn.backend == "flash_attn_2"
    monkeypatch.setattr(attention, "attend", lambda q, k, v, backend="sdpa":
                        (_ for _ in ()).throw(ImportError("no flash_attn")) if backend != "sdpa" else q)
    with pytest.warns(UserWarning, match="attention backend flash_attn_2 unavailable"):
        attn._attend(q, q, q)
    assert attn.backend == "sdpa"


@pytest.mark.parametrize("backend, mode, named", [
    ("inductor", "reduce-overhead", "compile_mode reduce-overhead"),
    ("inductor", "max-autotune", "compile_mode max-autotune"),
    ("cudagraphs", "default", "compile_backend cudagraphs"),
])
def test_cuda_graph_compile_modes_are_refused(backend, mode, named):
    with pytest.raises(OptionError, match=rf"^{named} records CUDA graphs.*Use compile_mode "
                                          r"max-autotune-no-cudagraphs"):
        CompileSettings(backend=backend, mode=mode)
    CompileSettings(backend="inductor", mode="max-autotune-no-cudagraphs")  # allowed


def test_load_models_refuses_cuda_graph_modes_before_loading(tiny_options):
    from seedvr2.api import load_models
    from seedvr2.options import resolve_options

    opts = resolve_options(device="cpu", dtype="fp32", compile=True, compile_mode="reduce-overhead")
    with pytest.raises(OptionError, match="compile_mode reduce-overhead records CUDA graphs"):
        load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                    model_dir=tiny_options["model_dir"])


# -- the budget's CUDA margins ------------------------------------------------------------------


def _budget() -> Budget:
    from seedvr2.models.config import dit_config, vae_config

    import json
    from conftest import conformance_dir
    kit = conformance_dir()
    dit = dit_config(json.loads((kit / "dit3b_tiny" / "config.json").read_text())["constructor_kwargs"])
    vae = vae_config(json.loads((kit / "vae_tiny" / "config.json").read_text())["constructor_kwargs"])
    return Budget(dit, vae, Weights.from_config("dit", dit, 2), Weights.from_config("vae", vae, 2))


def test_cuda_phases_carry_the_cuda_fixed_overhead():
    budget, job = _budget(), BatchShape(256, 448, 5)
    on_cuda = mem.estimate(budget, job, Placement("cuda:0", "cuda:0"))
    on_cpu = mem.estimate(budget, job, Placement("cpu", "cpu"))
    for gpu, cpu in zip(on_cuda.phases, on_cpu.phases):
        margin = dict(gpu.parts)["margin"] - dict(cpu.parts)["margin"]
        assert margin == mem.CUDA_FIXED_OVERHEAD - mem.FIXED_OVERHEAD
    assert GIB <= mem.CUDA_FIXED_OVERHEAD <= 2 * GIB


def test_auto_batch_plans_for_85_percent_of_cuda_memory():
    budget, job = _budget(), BatchShape(256, 448, 5)
    place = Placement("cuda:0", "cuda:0")
    need = {b: mem.estimate(budget, replace(job, batch_size=b), place).peak("cuda:0")
            for b in (5, 9, 13)}
    auto = lambda have: mem.auto_batch_size(budget, job, place, {"cuda:0": have}, 100, 0)  # noqa: E731
    assert auto(need[13] / mem.AUTO_CUDA_SHARE + 1) == 13
    # 13 frames fit the whole device but not 85 % of it: auto takes the largest that does.
    have = need[13] + 1
    planned = max([b for b in need if need[b] <= int(have * mem.AUTO_CUDA_SHARE)], default=5)
    assert planned < 13 and auto(have) == planned
    assert auto(need[5] + 1) == 5  # only the smallest fits: worth a try at the full memory


def test_cuda_shortfall_recommends_expandable_segments():
    with pytest.raises(BudgetError, match=r"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        mem.check(_budget(), BatchShape(720, 1280, 9), Placement(), {"cuda:0": GIB})


def test_host_copy_must_fit_host_ram():
    mem.check_host_copy(9 * GIB, 10 * GIB, "dit_offload_device")
    mem.check_host_copy(9 * GIB, None, "dit_offload_device")  # unknown: no check
    with pytest.raises(BudgetError, match=r"^dit_offload_device=cpu keeps a copy of the model's "
                                          r"weights in host RAM: 9\.5 GiB \(pinned.*Set "
                                          r"dit_offload_device=none"):
        mem.check_host_copy(int(9.5 * GIB), 10 * GIB, "dit_offload_device")


def test_offloading_a_model_checks_host_ram_before_copying(tiny_options, monkeypatch):
    from seedvr2.api import load_models
    from seedvr2.memory import MODEL_CACHE
    from seedvr2.options import resolve_options

    MODEL_CACHE.clear()
    monkeypatch.setattr(mem, "host_available", lambda: 0)
    monkeypatch.setattr(mem, "bytes_on", lambda module, device: 0)
    opts = resolve_options(device="cpu", dtype="fp32", vae_offload_device="cpu",
                           text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))
    with pytest.raises(BudgetError, match="vae_offload_device=cpu keeps a copy"):
        load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                    model_dir=tiny_options["model_dir"])
