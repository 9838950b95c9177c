"""compute_precision: which quantised layers multiply in their own precision through
comfy-kitchen (the dispatch per platform and compute capability, and the fallbacks), and each
format's low-precision DiT run on the CPU through comfy-kitchen's eager backend against the
dequantise path, within a bound derived from the format's step and the reduction length; every
product also checked, layer by layer, against its definition and its kernels' preconditions
(tests/kernel_checks.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import seedvr2
from seedvr2 import kernels
from seedvr2.kernels import Platform
from seedvr2.loading import load_dit
from seedvr2.loading.lowp import compute_path
from seedvr2.loading.quantize import quantize_file
from seedvr2.loading.packed import scheme_of
from seedvr2.loading.packed_layers import (PackedWeight, attach_packed_weight, packed_modules,
                                           set_compute_precision)

from conftest import (float_step_error, integer_step_error, load_case, quantization_bound,
                      relative_error)
from kernel_checks import KernelCheckFailed, capable_gpu

CUDA = torch.device("cuda", 0)


def _weight(scheme: str, rows=256, cols=256, **over) -> PackedWeight:
    """A packed weight with the layout of ``scheme`` (values irrelevant to the dispatch)."""
    parts = {
        "int8_rows": {"data": torch.zeros(rows, cols, dtype=torch.int8),
                      "scale": torch.ones(rows, 1)},
        "int8_convrot": {"data": torch.zeros(rows, cols, dtype=torch.int8),
                         "scale": torch.ones(rows, 1)},
        "fp8": {"data": torch.zeros(rows, cols, dtype=torch.float8_e4m3fn),
                "scale": torch.ones(())},
        "e5m2": {"data": torch.zeros(rows, cols, dtype=torch.float8_e5m2)},
        "mxfp8": {"data": torch.zeros(rows, cols, dtype=torch.float8_e4m3fn),
                  "scale": torch.zeros(rows, cols // 32, dtype=torch.uint8)},
        "nvfp4": {"data": torch.zeros(rows, cols // 2, dtype=torch.uint8),
                  "scale": torch.zeros(rows, cols // 16, dtype=torch.uint8),
                  "scale_2": torch.ones(())},
        "gguf": {"blocks": torch.zeros(rows * cols // 32, 34, dtype=torch.uint8)},
    }[scheme]
    parts.update(over.pop("parts", {}))
    params = {"int8_convrot": {"group_size": 256}, "gguf": {"qtype": "Q8_0"}}.get(scheme, {})
    stored = {"fp8": "float", "e5m2": "float"}.get(scheme, scheme)
    return PackedWeight(stored, (rows, cols), parts, {**params, **over})


@pytest.fixture
def kitchen_present(monkeypatch):
    monkeypatch.setattr(kernels, "kitchen_installed", lambda: True)


# ---------------------------------------------------------------------------------------------
# the dispatch table

# Compute capability -> the path each layout takes (Turing, Ampere, Ada, Hopper, Blackwell
# data centre and consumer). int8 from 7.5: comfy-kitchen's int8_linear states
# min_compute_capability=(7, 5) (RTX 20xx users ask for it).
CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
EXPECTED = {
    "int8_rows": ["int8", "int8", "int8", "int8", "int8", "int8", "int8"],
    "int8_convrot": ["int8", "int8", "int8", "int8", "int8", "int8", "int8"],
    "fp8": ["weights", "weights", "weights", "fp8", "fp8", "fp8", "fp8"],
    "mxfp8": ["weights", "weights", "weights", "weights", "weights", "mxfp8", "mxfp8"],
    "nvfp4": ["weights", "weights", "weights", "weights", "weights", "nvfp4", "nvfp4"],
    "e5m2": ["weights"] * 7,
    "gguf": ["weights"] * 7,
}


def _capable(monkeypatch, capability):
    """CUDA devices are NVIDIA GPUs of ``capability`` (torch built for CUDA 13); the CPU
    stays the CPU."""
    real = kernels.platform_of
    monkeypatch.setattr(kernels, "platform_of", lambda device: Platform(
        "cuda", capability, (13, 0)) if device.type == "cuda" else real(device))


@pytest.mark.parametrize("scheme", list(EXPECTED))
def test_each_capability_gets_its_path(scheme, kitchen_present, monkeypatch):
    got = []
    for capability in CAPABILITIES:
        _capable(monkeypatch, capability)
        got.append(compute_path(_weight(scheme), torch.bfloat16, CUDA, "auto"))
    assert got == EXPECTED[scheme]
    # compute_precision weights and the CPU (no capability): dequantise.
    assert compute_path(_weight(scheme), torch.bfloat16, CUDA, "weights") == "weights"
    assert compute_path(_weight(scheme), torch.bfloat16, torch.device("cpu"), "auto") == "weights"


def test_without_comfy_kitchen_every_layer_dequantises(monkeypatch):
    monkeypatch.setattr(kernels, "kitchen_installed", lambda: False)
    _capable(monkeypatch, (12, 0))
    assert {compute_path(_weight(s), torch.bfloat16, CUDA, "auto") for s in EXPECTED} == {"weights"}


def weight_path(weight: PackedWeight):
    """The low-precision path a packed weight's layout could take on a capable GPU (None:
    dequantise): its format's product, when the weight fits the product's kernels."""
    product = scheme_of(weight.scheme).product
    return None if product is None or product.fits(weight) is not None else product.path


@pytest.mark.parametrize("weight, reason", [
    (_weight("fp8", parts={"scale": torch.ones(256, 1)}), "per-channel fp8 scales"),
    (_weight("fp8", rows=200), "fp8 rows not a multiple of 16"),
    (_weight("int8_convrot", group_size=128), "ConvRot group not a power of 4"),
    (_weight("nvfp4", rows=200), "nvfp4 rows not a multiple of 16"),
    (_weight("nvfp4", cols=48), "nvfp4 input not a multiple of 32"),
    (_weight("mxfp8", cols=48), "mxfp8 input not a multiple of 32"),
])
def test_shapes_the_kernels_do_not_take_dequantise(weight, reason, kitchen_present, monkeypatch):
    _capable(monkeypatch, (12, 0))
    assert weight_path(weight) is None, reason
    assert compute_path(weight, torch.bfloat16, CUDA, "auto") == "weights"


def test_float_paths_need_half_precision_activations(kitchen_present, monkeypatch):
    _capable(monkeypatch, (12, 0))
    assert compute_path(_weight("fp8"), torch.float32, CUDA, "auto") == "weights"
    assert compute_path(_weight("nvfp4"), torch.float32, CUDA, "auto") == "weights"
    assert compute_path(_weight("int8_rows"), torch.float32, CUDA, "auto") == "int8"


def test_kitchen_lookup_without_the_package():
    """The policy's real lookup in a process where comfy_kitchen cannot be imported."""
    code = ("import sys; sys.modules['comfy_kitchen'] = None\n"
            "from seedvr2.kernels import kitchen_installed\n"
            "print(kitchen_installed())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_importing_the_pack_does_not_import_comfy_kitchen():
    code = ("import sys, seedvr2, seedvr2.loading.packed_layers, seedvr2.pipeline.job\n"
            "print(sys.modules.get('comfy_kitchen') is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# layers on the CPU through comfy-kitchen's eager backend

@pytest.fixture
def ck():
    """comfy-kitchen itself; these tests skip where it is not installed (the suite's other
    tests pass without it)."""
    return pytest.importorskip("comfy_kitchen", reason="comfy-kitchen (the kitchen extra) "
                                                       "not installed")


def _int8_layer(rows=32, cols=64):
    layer = torch.nn.Linear(cols, rows).to(torch.bfloat16)
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    scale = weight.abs().amax(1, keepdim=True) / 127
    packed = PackedWeight("int8_rows", (rows, cols), {
        "data": torch.round(weight / scale).to(torch.int8), "scale": scale})
    attach_packed_weight(layer, packed, torch.bfloat16, "blocks.0.mlp.vid.proj_in")
    return layer, packed


def test_a_declined_call_dequantises(monkeypatch, ck):
    layer, packed = _int8_layer()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, packed.dequantize(torch.bfloat16), layer.bias)
    set_compute_precision(layer, "auto")
    with capable_gpu((12, 0)):
        assert not torch.equal(layer(x), expected)  # the int8 product really runs

    def decline(**kwargs):
        raise ck.NoCapableBackendError("int8_linear", {})
    monkeypatch.setattr(ck, "int8_linear", lambda *a, **k: decline())
    with capable_gpu((12, 0)):
        assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("error", [
    RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"),
    AssertionError("num_rows must be divisible by 32, got 58"),
    ValueError("Unsupported scale dtype"),
])
def test_a_failing_kernel_dequantises_that_layer_for_the_rest_of_the_job(error, monkeypatch, ck,
                                                                          caplog):
    """Any error of a kernel (not only comfy-kitchen's BackendError) dequantises the layer,
    with one warning naming the layer, its format and the error, and the kernel is not tried
    again in this job; the next job (set_compute_precision) tries it again."""
    layer, packed = _int8_layer()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, packed.dequantize(torch.bfloat16), layer.bias)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise error
    monkeypatch.setattr(ck, "int8_linear", failing)
    set_compute_precision(layer, "auto")
    with capable_gpu((8, 0), check_products=False), caplog.at_level("WARNING", "seedvr2"):
        assert torch.equal(layer(x), expected)
        assert torch.equal(layer(x), expected)
    assert len(calls) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"blocks.0.mlp.vid.proj_in (int8_rows weights): the int8 low-precision product failed "
        f"({type(error).__name__}: {error}); this layer dequantises to bfloat16 for the rest "
        f"of the job"]
    set_compute_precision(layer, "auto")  # the next job
    with capable_gpu((8, 0), check_products=False):
        layer(x)
    assert len(calls) == 2


def test_a_cuda_error_that_poisons_the_context_is_raised_not_dequantised(monkeypatch, ck):
    """An illegal address (torch.AcceleratorError) is sticky: every later CUDA call of the
    process fails, often in another layer. Dequantising would hide where it came from and fail
    anyway: it is raised, and the layer is not marked as fallen back."""
    layer, _ = _int8_layer()

    def poisoned(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(ck, "int8_linear", poisoned)
    set_compute_precision(layer, "auto")
    with capable_gpu((8, 0), check_products=False), \
            pytest.raises(torch.AcceleratorError, match="illegal memory access"):
        layer(torch.randn(5, 64, dtype=torch.bfloat16))
    assert layer._lowp_failure is None


def test_mxfp8_activations_are_padded_to_the_quantisers_32_rows(ck):
    """comfy-kitchen's CUDA quantize_mxfp8 asserts num_rows % 32 == 0; the text stream alone
    has 58 tokens. The product pads (pad_32x) and slices, as kitchen's own layout does."""
    from seedvr2.loading.quantize import pack_weight

    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    packed = pack_weight(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)),
                         "mxfp8")
    attach_packed_weight(layer, packed, torch.bfloat16, "txt_in")
    set_compute_precision(layer, "auto")
    x = torch.randn(58, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with capable_gpu((10, 0)) as log:
        out = layer(x)
    assert out.shape == (58, 32) and log.products["mxfp8"] == 1
    assert log.calls["comfy_kitchen.quantize_mxfp8"] == 1


def test_a_quantiser_on_58_rows_is_what_the_cuda_kernel_refuses(ck):
    with capable_gpu((10, 0)), pytest.raises(KernelCheckFailed,
                                              match=r"x is 58 x 64, not multiples of 32"):
        ck.quantize_mxfp8(torch.randn(58, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("hip, capability", [("6.2", (9, 4)), ("6.2", (11, 0)), ("6.4", (12, 0))])
def test_amd_gpus_are_gated_on_the_platform_before_the_capability(hip, capability, monkeypatch,
                                                                   kitchen_present):
    """ROCm reports SM-shaped capabilities (MI300 9.4, RDNA3 11.x): none of them makes an AMD
    GPU an fp8/mxfp8/nvfp4 NVIDIA one. int8 runs there only where comfy-kitchen registers a
    ROCm backend for int8_linear."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert kernels.platform_of(CUDA) == Platform("rocm")
    for scheme in ("fp8", "mxfp8", "nvfp4"):
        assert compute_path(_weight(scheme), torch.bfloat16, CUDA, "auto") == "weights", scheme
    for reported, path in ((False, "weights"), (True, "int8")):
        monkeypatch.setattr(kernels, "kitchen_runs_on_rocm", lambda function: reported)
        assert compute_path(_weight("int8_rows"), torch.bfloat16, CUDA, "auto") == path


@pytest.mark.parametrize("torch_cuda, disabled, backend", [
    ("12.8", True, "eager backend: torch is built for CUDA 12.8"),
    (None, True, "eager backend: torch is built without CUDA"),
    ("13.0", False, "backend"),
])
def test_kitchens_cuda_kernels_need_torch_built_for_cuda_13(torch_cuda, disabled, backend, ck,
                                                            monkeypatch, caplog):
    """What ComfyUI's comfy/quant_ops.py does: below CUDA 13 (or without CUDA) kitchen's CUDA
    backend is disabled, and the log says which backend computes."""
    before = set(ck.registry._disabled)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    kernels._configure_kitchen.cache_clear()
    try:
        with caplog.at_level("INFO", "seedvr2"):
            assert kernels.kitchen() is ck
        assert ("cuda" in ck.registry._disabled) == disabled
        assert any(backend in r.getMessage() for r in caplog.records), caplog.text
    finally:
        ck.registry._disabled.clear()
        ck.registry._disabled.update(before)
        kernels._configure_kitchen.cache_clear()


def test_the_log_names_the_backend_that_computes(ck, monkeypatch, caplog):
    """Where kitchen's CUDA kernels are disabled (torch for CUDA 12.8) but its triton backend
    loaded, triton computes (it comes before eager in the registry's order): the log says so."""
    before = set(ck.registry._disabled)
    status = {name: dict(info) for name, info in ck.list_backends().items()}
    status["triton"]["available"] = True
    monkeypatch.setattr(ck, "list_backends", lambda: status)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    kernels._configure_kitchen.cache_clear()
    try:
        with caplog.at_level("INFO", "seedvr2"):
            kernels.kitchen()
        assert "computed by its triton backend: torch is built for CUDA 12.8" in caplog.text
    finally:
        ck.registry._disabled.clear()
        ck.registry._disabled.update(before)
        kernels._configure_kitchen.cache_clear()


@pytest.mark.parametrize("target, mistake", [
    ("nvfp4", "tensor scale x1.5"), ("nvfp4", "block scales re-tiled"),
    ("nvfp4", "activation nibbles swapped"), ("mxfp8", "block scales re-tiled"),
    ("int8", "weight scale x1.5"), ("fp8_e4m3fn", "weight scale x1.5"),
])
def test_each_layer_product_is_checked_against_its_definition(target, mistake, monkeypatch, ck):
    """A layout mistake the DiT-level bound cannot see (nvfp4's is 14x the measured error)
    fails the per-layer check: dequant(quant(x)) @ dequant(W).T is exact up to summation
    order."""
    from dataclasses import replace

    from seedvr2.loading.packed import SCHEMES
    from seedvr2.loading.quantize import pack_weight

    packed = pack_weight(torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.02,
                         target)
    scheme = SCHEMES[packed.scheme]
    right = scheme.product.run

    def wrong(ck_, x2d, weight, bias):
        parts = dict(weight.parts)
        if mistake.endswith("x1.5"):
            key = "scale_2" if target == "nvfp4" else "scale"
            parts[key] = parts[key] * 1.5
        elif mistake == "block scales re-tiled":
            raw = parts["scale"].view(torch.uint8)
            parts["scale"] = raw.reshape(-1, 32, 4, 4).transpose(1, 2).reshape(raw.shape) \
                .view(parts["scale"].dtype)
        else:  # the product sees a kitchen whose nvfp4 quantiser swaps the two nibbles
            kitchen = ck_

            class Swapped:
                def __getattr__(self, name):
                    return getattr(kitchen, name)

                def quantize_nvfp4(self, *args, **kwargs):
                    codes, scales = kitchen.quantize_nvfp4(*args, **kwargs)
                    return (codes << 4) | (codes >> 4), scales
            return right(Swapped(), x2d, replace(weight, parts=parts), bias)
        return right(ck_, x2d, replace(weight, parts=parts), bias)
    layer = torch.nn.Linear(256, 128).to(torch.bfloat16)
    attach_packed_weight(layer, packed, torch.bfloat16, "blocks.1.attn.proj_qkv.vid")
    set_compute_precision(layer, "auto")
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with capable_gpu((12, 0)) as log:
        layer(x)  # the right product passes
    assert sum(log.products.values()) == 1
    monkeypatch.setitem(SCHEMES, packed.scheme, replace(scheme, product=replace(
        scheme.product, run=wrong)))
    with capable_gpu((12, 0)), pytest.raises(KernelCheckFailed, match="differs from dequant"):
        layer(x)


def test_unknown_compute_precision_is_named():
    with pytest.raises(ValueError, match=r"compute_precision 'fast': expected one of auto, weights"):
        set_compute_precision(torch.nn.Linear(2, 2), "fast")


# ---------------------------------------------------------------------------------------------
# the tiny 3B DiT per format: low-precision path against the dequantise path


@pytest.fixture(scope="module")
def tiny_fp32(conformance, tiny_model_dir):
    return tiny_model_dir / "dit3b_tiny.safetensors", load_case(conformance / "dit3b_tiny", "image")


def _bf16_output(model, case):
    with torch.no_grad():
        return model(case["inputs.vid"].bfloat16(), case["inputs.txt"].bfloat16(),
                     case["inputs.vid_shape"], case["inputs.txt_shape"],
                     case["inputs.timestep"]).float()


# Relative rms error each format's activation quantisation adds to one layer's input (the
# weights are the same codes in both paths): int8 per row of K values (the absmax of K ~Gaussian
# values is below sqrt(2 ln 2K) of their rms; K the layer's reduction length, at most 512 here);
# e4m3 (3 mantissa bits) per tensor (fp8) or per 32 (mxfp8); e2m1 (1 bit) per 16 (nvfp4).
ACTIVATION_ERROR = {"int8": integer_step_error(127, 512), "int8_convrot": integer_step_error(127, 512),
                    "fp8_e4m3fn": float_step_error(3), "mxfp8": float_step_error(3),
                    "nvfp4": float_step_error(1)}
PATH_OF = {"int8": "int8", "int8_convrot": "int8", "fp8_e4m3fn": "fp8", "mxfp8": "mxfp8",
           "nvfp4": "nvfp4"}


@pytest.mark.parametrize("target", list(ACTIVATION_ERROR))
def test_low_precision_dit_within_the_format_bound(target, tiny_fp32, monkeypatch, ck,
                                                   tmp_path):
    source, case = tiny_fp32
    path = tmp_path / f"{target}.safetensors"
    quantize_file(source, path, target)
    model = load_dit(path, dtype=torch.bfloat16)
    packed = packed_modules(model)
    assert len(packed) == 30  # every block linear fits every format's blocks here
    dequantised = _bf16_output(model, case)
    taken = []
    real = compute_path
    monkeypatch.setattr(sys.modules["seedvr2.loading.packed_layers"], "compute_path",
                        lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    set_compute_precision(model, "auto")
    with capable_gpu((12, 0)) as log:  # every layer's product also checked by its definition
        low = _bf16_output(model, case)
    assert set(taken) == {PATH_OF[target]} and len(taken) >= len(packed)
    assert log.products[PATH_OF[target]] == len(taken)
    error = relative_error(low, dequantised)
    # Each quantised layer's input is rounded to the format (ACTIVATION_ERROR) and, in both
    # paths, its output to bf16 (8 significant bits), which then rounds differently downstream:
    # one more bf16 step per layer and path. Independent layers add in quadrature.
    bound = quantization_bound([ACTIVATION_ERROR[target]] * len(packed)
                               + [float_step_error(7)] * 2 * len(packed))
    print(f"DiT 3B tiny, {target}: low-precision path vs dequantised, relative error "
          f"{error:.2e} (bound {bound:.2e})")
    # The floor: the activations really were quantised (the two bf16 runs of one path agree
    # exactly on the CPU).
    assert 0 < error < bound


# ---------------------------------------------------------------------------------------------
# the option reaches the layers of a job


def test_a_job_runs_its_compute_precision(tiny_options, tmp_path, monkeypatch, ck):
    """seedvr2.upscale with an int8 DiT: auto takes the int8 product on a capable device (here
    the CPU standing in for an Ampere GPU), weights and an incapable device dequantise."""
    int8 = tmp_path / "dit3b_tiny_int8.safetensors"
    quantize_file(tiny_options["dit"], int8, "int8")
    frames = torch.rand(1, 24, 32, 3, generator=torch.Generator().manual_seed(4))
    run = lambda precision: seedvr2.upscale(  # noqa: E731
        frames, **{**tiny_options, "dit": str(int8), "dtype": "bf16"}, resolution=32,
        compute_precision=precision)
    dequantised = run("weights")
    assert torch.equal(run("auto"), dequantised)  # the CPU has no low-precision units
    monkeypatch.setattr(kernels, "kitchen_installed", lambda: True)
    monkeypatch.setattr(kernels, "platform_of", lambda device: Platform("cuda", (8, 0), (13, 0)))
    products = []
    real = ck.int8_linear
    monkeypatch.setattr(ck, "int8_linear", lambda *a, **k: products.append(1) or real(*a, **k))
    # The patched platform also moves the VAE onto its fused-norm path (vae_paths reads the same
    # platform), so the dequantised run to compare with is the one on the same platform.
    dequantised_there = run("weights")
    assert products == []
    low = run("auto")
    assert len(products) >= 30 and not torch.equal(low, dequantised_there)
