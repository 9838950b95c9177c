"""The external kernels' preconditions (seedvr2.kernels): every rule catches a call that breaks
it, directly and through the CPU stand-in (tests/kernel_checks.py), every stated capability
keeps older GPUs off the kernel, and the quoted facts match the installed comfy-kitchen."""

from __future__ import annotations

import re

import pytest
import torch

from seedvr2.kernels import KERNELS, Platform

from kernel_checks import WRAPPED, KernelCheckFailed, capable_gpu


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


E4M3, E8M0, U8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8
ONE = torch.ones((), dtype=torch.float32)


def _mx(a_rows=32, b_rows=64, k=64, **over):
    args = {"a": meta(a_rows, k, dtype=E4M3), "b": meta(b_rows, k, dtype=E4M3),
            "block_scale_a": meta(128, 4, dtype=E8M0), "block_scale_b": meta(128, 4, dtype=E8M0),
            "out_dtype": torch.bfloat16}
    return {**args, **over}


def _nv(a_rows=32, b_rows=64, k=64, **over):
    args = {"a": meta(a_rows, k // 2, dtype=U8), "b": meta(b_rows, k // 2, dtype=U8),
            "tensor_scale_a": ONE, "tensor_scale_b": ONE, "alpha": ONE,
            "block_scale_a": meta(128, 4, dtype=E4M3), "block_scale_b": meta(128, 4, dtype=E4M3),
            "out_dtype": torch.bfloat16}
    return {**args, **over}


def _int8(**over):
    args = {"x": meta(16, 256), "weight": meta(64, 256, dtype=torch.int8),
            "weight_scale": meta(64, dtype=torch.float32), "convrot": False,
            "convrot_groupsize": 256}
    return {**args, **over}


def _mm(**over):
    args = {"self": meta(16, 64, dtype=E4M3), "mat2": meta(32, 64, dtype=E4M3).t(),
            "scale_a": meta((), dtype=torch.float32), "scale_b": meta((), dtype=torch.float32)}
    return {**args, **over}


F16 = torch.float16


def _gn(**over):
    """A group_norm_silu_pad3d call as the VAE makes it: per-frame stats, no padding."""
    args = {"x": meta(2, 16, 3, 8, 8), "weight": meta(16), "bias": meta(16), "num_groups": 4,
            "eps": 1e-6, "pad": (0, 0, 0, 0, 0), "silu": True, "zero_pad": True,
            "out": meta(2, 16, 3, 8, 8), "stats": meta(6, 4, 2, dtype=torch.float32)}
    return {**args, **over}


def _conv(**over):
    """An fp16_conv3d call as the VAE makes it: padded input, the shortcut as residual."""
    args = {"x": meta(1, 8, 5, 8, 8, dtype=F16), "weight": meta(16, 8, 3, 3, 3, dtype=F16),
            "bias": meta(16, dtype=F16), "residual": meta(1, 16, 3, 6, 6, dtype=F16),
            "stride": [1, 1, 1]}
    return {**args, **over}


def _attention(**over):
    q = meta(1, 2, 40, 64)
    return {**{"query": q, "key": q, "value": q}, **over}


# (kernel, rule index) -> a call that breaks that rule (and what the message says).
VIOLATIONS = {
    ("comfy_kitchen.quantize_mxfp8", 0): ({"x": meta(58, 64), "pad_32x": False},
                                          "x is 58 x 64, not multiples of 32"),
    ("comfy_kitchen.quantize_mxfp8", 1): ({"x": meta(64, 64).t(), "pad_32x": True},
                                          "x not contiguous"),
    ("comfy_kitchen.quantize_mxfp8", 2): ({"x": meta(2, 32, 32), "pad_32x": True},
                                          "x has 3 dimensions, not 2"),
    ("comfy_kitchen.scaled_mm_mxfp8", 0): (_mx(a=meta(32, 64)), "a is torch.bfloat16"),
    ("comfy_kitchen.scaled_mm_mxfp8", 1): (_mx(block_scale_b=meta(64, 2, dtype=E8M0)),
                                           "block_scale_b is [64, 2], not [128, 4]"),
    ("comfy_kitchen.scaled_mm_mxfp8", 2): (_mx(b=meta(64, 96, dtype=E4M3)), "their K differ"),
    ("comfy_kitchen.scaled_mm_mxfp8", 3): (_mx(b_rows=40), "K or N not divisible by 16"),
    ("comfy_kitchen.quantize_nvfp4", 0): ({"x": meta(58, 64), "per_tensor_scale": ONE,
                                           "pad_16x": False}, "x is 58 x 64, not multiples of 16"),
    ("comfy_kitchen.quantize_nvfp4", 1): ({"x": meta(64, 64).t(), "per_tensor_scale": ONE,
                                           "pad_16x": True}, "x not contiguous"),
    ("comfy_kitchen.quantize_nvfp4", 2): ({"x": meta(64, 64), "pad_16x": True,
                                           "per_tensor_scale": ONE.half()},
                                          "per_tensor_scale is torch.float16"),
    ("comfy_kitchen.scaled_mm_nvfp4", 0): (_nv(out_dtype=torch.float32),
                                           "out_dtype not float16/bfloat16"),
    ("comfy_kitchen.scaled_mm_nvfp4", 1): (_nv(b_rows=20, block_scale_b=meta(128, 4, dtype=E4M3)),
                                           "N = 20 is not a multiple of 8"),
    ("comfy_kitchen.scaled_mm_nvfp4", 2): (_nv(block_scale_a=meta(32, 4, dtype=E4M3)),
                                           "block_scale_a is [32, 4], not [128, 4]"),
    ("comfy_kitchen.scaled_mm_nvfp4", 3): (_nv(b=meta(64, 48, dtype=U8)), "their K differ"),
    ("comfy_kitchen.scaled_mm_nvfp4", 4): (_nv(alpha=ONE * 1.5),
                                           "alpha is not tensor_scale_a * tensor_scale_b"),
    ("comfy_kitchen.int8_linear", 0): (_int8(weight=meta(64, 256, dtype=U8)),
                                       "weight is torch.uint8"),
    ("comfy_kitchen.int8_linear", 1): (_int8(weight_scale=meta(65, dtype=torch.float32)),
                                       "weight_scale has 65 values, not 1 or 64"),
    ("comfy_kitchen.int8_linear", 2): (_int8(convrot=True, convrot_groupsize=128),
                                       "convrot_groupsize 128 is not a power of 4"),
    ("comfy_kitchen.quantize_per_tensor_fp8", 0): (
        {"x": meta(16, 64), "scale": meta((), dtype=torch.float16)}, "scale is torch.float16"),
    ("comfy_kitchen.quantize_per_tensor_fp8", 1): (
        {"x": meta(16, 64), "scale": torch.ones((), dtype=torch.float32)},
        "scale is [] on cpu, not one value on x's device (meta)"),
    ("comfy_kitchen.quantize_per_tensor_fp8", 2): (
        {"x": meta(3, 20), "scale": meta((), dtype=torch.float32)},
        "x has 60 elements, not a multiple of 16"),
    ("torch._scaled_mm", 0): (_mm(mat2=meta(64, 32, dtype=E4M3)),
                              "mat2 has strides [32, 1], not column-major"),
    ("torch._scaled_mm", 1): (_mm(self=meta(16, 40, dtype=E4M3), mat2=meta(32, 40, dtype=E4M3).t()),
                              "self is [16, 40]: size(1) not divisible by 16"),
    ("torch._scaled_mm", 2): (_mm(scale_b=meta((), dtype=torch.float16)),
                              "scales are torch.float32 and torch.float16, not float32"),
    ("torch.nn.functional.scaled_dot_product_attention", 0): (
        _attention(query=meta(1, 2, 40, 320), key=meta(1, 2, 40, 320), value=meta(1, 2, 40, 320)),
        "head dimension 320 is over 256 or not a multiple of 8"),
    ("comfy_kitchen.group_norm_silu_pad3d", 0): (_gn(x=meta(1, 16, 3, 8, 8, dtype=torch.float32)),
                                                 "x is torch.float32"),
    ("comfy_kitchen.group_norm_silu_pad3d", 1): (
        _gn(stats=meta(3, 4, 2, dtype=torch.float32)), "not float32 [6, 4, 2]"),
    ("comfy_kitchen.group_norm_silu_pad3d", 2): (_gn(out=meta(2, 16, 5, 8, 8)),
                                                 "not torch.bfloat16 [2, 16, 3, 8, 8]"),
    ("comfy_kitchen.group_norm_silu_pad3d", 3): (
        _gn(x=meta(1, 256, 7, 1088, 1920), stats=meta(7, 4, 2, dtype=torch.float32), out=None),
        "2^30 or more"),
    ("comfy_kitchen.fp16_conv3d", 0): (_conv(x=meta(1, 8, 3, 6, 6)), "x is torch.bfloat16"),
    ("comfy_kitchen.fp16_conv3d", 1): (_conv(residual=meta(1, 16, 3, 8, 8, dtype=F16)),
                                       "residual is [1, 16, 3, 8, 8], not the output's"),
    ("comfy_kitchen.fp16_conv3d", 2): (_conv(x=meta(1, 128, 7, 1090, 1922, dtype=F16),
                                             residual=None), "2^30 or more"),
    ("torch.nn.functional.conv3d", 0): ({"input": meta(1, 128, 33, 1088, 1920),
                                         "weight": meta(128, 128, 3, 3, 3)},
                                        "the input has 8823767040 elements, 2^31 or more"),
}


def test_every_rule_has_a_violating_call():
    rules = {(name, i) for name, kernel in KERNELS.items() for i in range(len(kernel.rules))}
    assert set(VIOLATIONS) == rules


@pytest.mark.parametrize("kernel, index", sorted(VIOLATIONS))
def test_each_rule_catches_a_call_that_breaks_it(kernel, index):
    args, message = VIOLATIONS[(kernel, index)]
    rule = KERNELS[kernel].rules[index]
    problem = rule.problem(args)
    assert problem is not None and message in problem, problem
    assert any(rule.quote in v for v in KERNELS[kernel].violations(args))


@pytest.mark.parametrize("spec", WRAPPED, ids=lambda spec: spec.kernel)
def test_the_cpu_stand_in_refuses_what_the_gpu_kernel_refuses(spec):
    """Through capable_gpu, the call reaches the wrapper, which refuses it before any CPU
    implementation runs (meta tensors: nothing is computed)."""
    if spec.module == "comfy_kitchen":
        pytest.importorskip("comfy_kitchen", reason="comfy-kitchen not installed")
    index = next(i for (k, i) in sorted(VIOLATIONS) if k == spec.kernel)
    args, message = VIOLATIONS[(spec.kernel, index)]
    with capable_gpu((12, 0)):
        import importlib

        function = getattr(importlib.import_module(spec.module), spec.attribute)
        with pytest.raises(KernelCheckFailed, match=re.escape(message)):
            function(**args)


@pytest.mark.parametrize("name", [n for n, k in KERNELS.items() if k.capability])
def test_a_stated_capability_keeps_older_gpus_off_the_kernel(name):
    kernel = KERNELS[name]
    major, minor = kernel.capability
    below = (major, minor - 1) if minor else (major - 1, 9)
    assert kernel.runs_on(Platform("cuda", kernel.capability, (13, 0))) is None
    reason = kernel.runs_on(Platform("cuda", below, (13, 0)))
    assert reason is not None and kernel.capability_quote in reason
    assert kernel.runs_on(Platform("cpu")) == f"{name} needs a GPU"


def test_quoted_capabilities_match_the_installed_comfy_kitchen():
    pytest.importorskip("comfy_kitchen", reason="comfy-kitchen not installed")
    import comfy_kitchen
    from comfy_kitchen.backends import cuda
    from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout

    from seedvr2.kernels import KITCHEN_VERSION

    constraints = cuda._build_constraints()
    for function in ("int8_linear", "scaled_mm_nvfp4"):
        assert constraints[function].min_compute_capability == \
            KERNELS[f"comfy_kitchen.{function}"].capability
    assert TensorCoreMXFP8Layout.MIN_SM_VERSION == KERNELS["comfy_kitchen.scaled_mm_mxfp8"].capability
    from importlib.metadata import version

    assert version("comfy-kitchen") == KITCHEN_VERSION, comfy_kitchen.__file__
