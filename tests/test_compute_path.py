"""compute_precision: which quantised layers multiply in their own precision through
comfy-kitchen (the dispatch table per compute capability, and the fallbacks), and each
format's low-precision DiT run on the CPU through comfy-kitchen's eager backend against the
dequantise path, within a bound derived from the format's step and the reduction length."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import seedvr2
from seedvr2.loading import load_dit
from seedvr2.loading.quantize import quantize_file
from seedvr2.loading.quantized import (PackedWeight, attach_packed_weight, packed_modules,
                                       set_compute_precision)
from seedvr2.memory import compute_path as policy
from seedvr2.memory.compute_path import compute_path, weight_path

from conftest import (REPO, float_step_error, integer_step_error, load_case, quantization_bound,
                      relative_error)

sys.path.insert(0, str(REPO / "bench"))
import gpu_checks  # noqa: E402

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
    monkeypatch.setattr(policy, "kitchen_installed", lambda: True)


# ---------------------------------------------------------------------------------------------
# the dispatch table

# Compute capability -> the path each layout takes (Turing, Ampere, Ada, Hopper, Blackwell
# data centre and consumer).
CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
EXPECTED = {
    "int8_rows": ["weights", "int8", "int8", "int8", "int8", "int8", "int8"],
    "int8_convrot": ["weights", "int8", "int8", "int8", "int8", "int8", "int8"],
    "fp8": ["weights", "weights", "weights", "fp8", "fp8", "fp8", "fp8"],
    "mxfp8": ["weights", "weights", "weights", "weights", "weights", "mxfp8", "mxfp8"],
    "nvfp4": ["weights", "weights", "weights", "weights", "weights", "nvfp4", "nvfp4"],
    "e5m2": ["weights"] * 7,
    "gguf": ["weights"] * 7,
}


def _capable(monkeypatch, capability):
    """CUDA devices report ``capability``; the CPU keeps reporting none."""
    real = policy.device_capability
    monkeypatch.setattr(policy, "device_capability",
                        lambda device: capability if device.type == "cuda" else real(device))


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
    monkeypatch.setattr(policy, "kitchen_installed", lambda: False)
    _capable(monkeypatch, (12, 0))
    assert {compute_path(_weight(s), torch.bfloat16, CUDA, "auto") for s in EXPECTED} == {"weights"}


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
    assert weight_path(weight.scheme, weight.parts, weight.shape, weight.params) is None, reason
    assert compute_path(weight, torch.bfloat16, CUDA, "auto") == "weights"


def test_float_paths_need_half_precision_activations(kitchen_present, monkeypatch):
    _capable(monkeypatch, (12, 0))
    assert compute_path(_weight("fp8"), torch.float32, CUDA, "auto") == "weights"
    assert compute_path(_weight("nvfp4"), torch.float32, CUDA, "auto") == "weights"
    assert compute_path(_weight("int8_rows"), torch.float32, CUDA, "auto") == "int8"


def test_kitchen_lookup_without_the_package():
    """The policy's real lookup in a process where comfy_kitchen cannot be imported."""
    code = ("import sys; sys.modules['comfy_kitchen'] = None\n"
            "from seedvr2.memory.compute_path import kitchen_installed\n"
            "print(kitchen_installed())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_importing_the_pack_does_not_import_comfy_kitchen():
    code = ("import sys, seedvr2, seedvr2.loading.quantized, seedvr2.pipeline.setup\n"
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


@pytest.fixture
def any_device_capable(ck):
    """Every device, the CPU included, reports a Blackwell's capability, and the mxfp8/nvfp4
    products (which the CPU cannot run) are their definition: the rehearsal's stand-in
    (bench/gpu_checks.py's cpu_as_blackwell), so every path is taken."""
    with gpu_checks.cpu_as_blackwell():
        yield


def test_a_declined_call_dequantises(monkeypatch, any_device_capable, ck):
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    weight = torch.randn(32, 64)
    scale = weight.abs().amax(1, keepdim=True) / 127
    packed = PackedWeight("int8_rows", (32, 64), {
        "data": torch.round(weight / scale).to(torch.int8), "scale": scale})
    attach_packed_weight(layer, packed, torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, packed.dequantize(torch.bfloat16), layer.bias)
    set_compute_precision(layer, "auto")
    assert not torch.equal(layer(x), expected)  # the int8 product really runs

    def decline(**kwargs):
        raise ck.NoCapableBackendError("int8_linear", {})
    monkeypatch.setattr(ck, "int8_linear", lambda *a, **k: decline())
    assert torch.equal(layer(x), expected)


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
def test_low_precision_dit_within_the_format_bound(target, tiny_fp32, monkeypatch,
                                                   any_device_capable, tmp_path):
    source, case = tiny_fp32
    path = tmp_path / f"{target}.safetensors"
    quantize_file(source, path, target)
    model = load_dit(path, dtype=torch.bfloat16)
    packed = packed_modules(model)
    assert len(packed) == 30  # every block linear fits every format's blocks here
    dequantised = _bf16_output(model, case)
    taken = []
    real = policy.compute_path
    monkeypatch.setattr(sys.modules["seedvr2.loading.quantized"], "compute_path",
                        lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    set_compute_precision(model, "auto")
    low = _bf16_output(model, case)
    assert set(taken) == {PATH_OF[target]} and len(taken) >= len(packed)
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
    monkeypatch.setattr(policy, "kitchen_installed", lambda: True)
    monkeypatch.setattr(policy, "device_capability", lambda device: (8, 0))
    products = []
    real = ck.int8_linear
    monkeypatch.setattr(ck, "int8_linear", lambda *a, **k: products.append(1) or real(*a, **k))
    assert torch.equal(run("weights"), dequantised) and products == []
    low = run("auto")
    assert len(products) >= 30 and not torch.equal(low, dequantised)
