"""Kernel preconditions on the CPU: the dispatch driven as a GPU of a chosen platform and
compute capability drives it, and every call of an external kernel checked against what its GPU
implementation requires.

The CPU runs comfy-kitchen's eager backend and torch's CPU kernels, which accept calls the
CUDA kernels refuse (an mxfp8 quantiser on 58 rows, a ``_scaled_mm`` operand that is not
column-major). Inside :func:`capable_gpu`:

* ``seedvr2.kernels.platform_of`` reports the chosen platform for every device (the CPU
  standing in), so ``loading.lowp`` picks the paths that GPU would take;
* every entry of :data:`WRAPPED` is replaced by a wrapper that binds the call's arguments to
  the kernel's parameter names, checks them against the kernel's rules in
  ``seedvr2.kernels.KERNELS`` (quoted there with their source and version) and raises
  :class:`KernelCheckFailed` naming the rule on any violation; then runs the CPU
  implementation, or the kernel's definition where the CPU has none (block-scaled matmuls);
* every low-precision product of a layer is checked against its definition,
  ``dequant(quant(x)) @ dequant(W).T + bias``, computed from the activations as the kernel's
  quantiser rounded them and the layer's weight as the loader dequantises it: exact up to
  summation order, so a tensor scale off by 1.5, block scales in another tile order or
  swapped nibbles fail here, however small the model.

:class:`KernelCheckFailed` is a ``BaseException``: the layers' fall-back (any ``Exception`` of
a kernel dequantises the layer) cannot swallow it. The returned :class:`KernelLog` counts the
calls per kernel and the layers per path.

The VAE's ``group_norm_silu_pad3d`` and ``fp16_conv3d`` (issue #36) are checked likewise;
their results against today's path are tests/test_vae_paths.py's. To check more kernels: quote
their rules once in ``seedvr2.kernels.KERNELS``, add a :class:`Wrapped` entry here naming where
the code calls them (module and attribute), the parameter names, and a stand-in where the CPU
cannot run them; add a violating call per rule to ``tests/test_kernel_preconditions.py``
(which fails while a rule has none). docs/development.md, "Kernel preconditions".
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from seedvr2 import kernels
from seedvr2.kernels import KERNELS, Platform


class KernelCheckFailed(BaseException):
    """A call the GPU kernel would refuse, or a product that is not its definition."""


@dataclass(frozen=True)
class Wrapped:
    """Where our code calls the kernel ``kernel`` (a key of ``seedvr2.kernels.KERNELS``):
    ``module`` and ``attribute`` are patched; ``params`` names the positional parameters
    (None: read from the function's signature); ``stand_in(original, args)`` runs instead of
    ``original`` on the CPU (None: the CPU implementation runs)."""

    kernel: str
    module: str
    attribute: str
    params: Optional[tuple[str, ...]] = None
    stand_in: Optional[Callable] = None


def _fp32_linear(a, b, bias, out_dtype):
    out = torch.nn.functional.linear(a, b, None if bias is None else bias.float())
    return out.to(out_dtype or torch.bfloat16)


def _mxfp8_definition(original, args):
    """comfy-kitchen's ``scaled_mm_mxfp8``: ``dequant(a) @ dequant(b).T + bias`` (torch's
    block-scaled matmul, which the CPU lacks: 'CPU does not support swizzle')."""
    import comfy_kitchen as ck

    deq = lambda t, s: ck.dequantize_mxfp8(t, s, torch.float32)  # noqa: E731
    return _fp32_linear(deq(args["a"], args["block_scale_a"]), deq(args["b"], args["block_scale_b"]),
                        args.get("bias"), args.get("out_dtype"))


def _nvfp4_definition(original, args):
    """The CUDA ``scaled_mm_nvfp4``: ``(blocks(a) @ blocks(b).T) · alpha + bias``, the tensor
    scales entering through ``alpha`` only (cuBLAS' block-scaled GEMM)."""
    import comfy_kitchen as ck

    one = torch.ones((), dtype=torch.float32)
    deq = lambda t, s: ck.dequantize_nvfp4(t, one, s, torch.float32)  # noqa: E731
    out = torch.nn.functional.linear(deq(args["a"], args["block_scale_a"]),
                                     deq(args["b"], args["block_scale_b"]))
    out = out * args["alpha"].float().reshape(())
    if args.get("bias") is not None:
        out = out + args["bias"].float()
    return out.to(args.get("out_dtype") or torch.bfloat16)


_SCALED_MM = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype",
              "use_fast_accum")
_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")

WRAPPED: tuple[Wrapped, ...] = (
    Wrapped("comfy_kitchen.quantize_mxfp8", "comfy_kitchen", "quantize_mxfp8"),
    Wrapped("comfy_kitchen.scaled_mm_mxfp8", "comfy_kitchen", "scaled_mm_mxfp8",
            stand_in=_mxfp8_definition),
    Wrapped("comfy_kitchen.quantize_nvfp4", "comfy_kitchen", "quantize_nvfp4"),
    Wrapped("comfy_kitchen.scaled_mm_nvfp4", "comfy_kitchen", "scaled_mm_nvfp4",
            stand_in=_nvfp4_definition),
    Wrapped("comfy_kitchen.int8_linear", "comfy_kitchen", "int8_linear"),
    Wrapped("comfy_kitchen.quantize_per_tensor_fp8", "comfy_kitchen", "quantize_per_tensor_fp8"),
    Wrapped("comfy_kitchen.group_norm_silu_pad3d", "comfy_kitchen", "group_norm_silu_pad3d"),
    Wrapped("comfy_kitchen.fp16_conv3d", "comfy_kitchen", "fp16_conv3d"),
    Wrapped("torch._scaled_mm", "torch", "_scaled_mm", params=_SCALED_MM),
    Wrapped("torch.nn.functional.scaled_dot_product_attention", "torch.nn.functional",
            "scaled_dot_product_attention", params=_SDPA),
    Wrapped("torch.nn.functional.conv3d", "torch.nn.functional", "conv3d", params=_CONV),
)


@dataclass
class KernelLog:
    """What ran inside :func:`capable_gpu`."""

    platform: Platform
    calls: Counter = field(default_factory=Counter)  # kernel -> calls
    products: Counter = field(default_factory=Counter)  # path -> layer products checked
    layers: dict = field(default_factory=dict)  # id of a layer's weight -> path it ran on
    quantised: list = field(default_factory=list)  # the activations of the running product


def _bind(spec: Wrapped, original, args, kwargs) -> dict:
    if spec.params is not None:
        bound = dict(zip(spec.params, args))
        bound.update(kwargs)
        return bound
    signature = inspect.signature(original)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _wrapper(spec: Wrapped, original, log: KernelLog, stand_ins: bool = True):
    rules = KERNELS[spec.kernel]

    def call(*args, **kwargs):
        bound = _bind(spec, original, args, kwargs)
        broken = rules.violations(bound)
        if broken:
            raise KernelCheckFailed("; ".join(broken))
        log.calls[spec.kernel] += 1
        out = spec.stand_in(original, bound) if spec.stand_in and stand_ins else \
            original(*args, **kwargs)
        if spec.kernel.startswith("comfy_kitchen.quantize"):
            log.quantised.append((spec.kernel, bound, out))
        return out
    call.__wrapped__ = original
    return call


@contextlib.contextmanager
def capable_gpu(capability=(12, 0), *, platform: str = "cuda", torch_cuda=(13, 0),
                check_products: bool = True, wrapped: tuple[Wrapped, ...] = WRAPPED):
    """The CPU standing in for a GPU of ``platform`` (``cuda``: NVIDIA of compute
    ``capability``, torch built for CUDA ``torch_cuda``; ``rocm``: AMD), every call of the
    ``wrapped`` kernels checked (see the module doc). Yields a :class:`KernelLog`."""
    stand_in = Platform(platform, tuple(capability) if platform == "cuda" else None,
                        tuple(torch_cuda) if platform == "cuda" else None)
    log = KernelLog(stand_in)
    patches = []  # (object, attribute, previous value)

    def patch(obj, name, value):
        patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    ck = _kitchen_or_none()
    disabled = set(ck.registry._disabled) if ck is not None else None
    try:
        patch(kernels, "platform_of", lambda device: stand_in)
        patch(kernels, "kitchen_installed", lambda: ck is not None)
        patch(kernels, "kitchen_cuda_missing", lambda: None)  # its CUDA backend, as loaded
        patch(torch.version, "cuda", ".".join(map(str, torch_cuda)) if platform == "cuda"
              else None)
        kernels._configure_kitchen.cache_clear()
        with checked_kernels(log, wrapped), \
                checked_products(log) if check_products else contextlib.nullcontext(log):
            yield log
    finally:
        for obj, name, value in reversed(patches):
            setattr(obj, name, value)
        kernels._configure_kitchen.cache_clear()
        if ck is not None:
            ck.registry._disabled.clear()
            ck.registry._disabled.update(disabled)


@contextlib.contextmanager
def checked_kernels(log: KernelLog, wrapped: tuple[Wrapped, ...] = WRAPPED,
                    stand_ins: bool = True):
    """Every call of the ``wrapped`` kernels checked against its preconditions and counted
    in ``log``, the quantisers' calls recorded (what :func:`checked_products` compares with);
    ``stand_ins``: the CPU's stand-ins run where the CPU lacks the kernel (False on a GPU, real
    or fake, where the kernel itself runs)."""
    ck = _kitchen_or_none()
    patches = []
    try:
        for spec in wrapped:
            if spec.module == "comfy_kitchen" and ck is None:
                continue
            module = importlib.import_module(spec.module)
            original = getattr(module, spec.attribute)
            patches.append((module, spec.attribute, original))
            setattr(module, spec.attribute, _wrapper(spec, original, log, stand_ins))
        yield log
    finally:
        for obj, name, value in reversed(patches):
            setattr(obj, name, value)


def _kitchen_or_none():
    try:
        import comfy_kitchen
    except ImportError:
        return None
    return comfy_kitchen


# ---------------------------------------------------------------------------------------------
# each layer's product against its definition


@contextlib.contextmanager
def checked_products(log: Optional[KernelLog] = None, compare: bool = True):
    """Every layer's low-precision product checked against its definition (see the module
    doc), on whatever device computes: inside :func:`capable_gpu` on the CPU, inside
    :func:`checked_kernels` on a GPU (bench/gpu_checks.py's lowp section: the quantiser's calls
    are what the definition starts from). ``compare=False`` (fake tensors: no values) builds
    the definition all the same (its shapes, dtypes and devices, from the quantiser's recorded
    call) without comparing values. Yields the :class:`KernelLog` counting them."""
    from seedvr2.loading import packed_layers

    log = log if log is not None else KernelLog(Platform("(this device)"))
    original = packed_layers.low_precision_linear
    packed_layers.low_precision_linear = _checked_product(original, log, compare)
    try:
        yield log
    finally:
        packed_layers.low_precision_linear = original


def _checked_product(original, log: KernelLog, compare: bool = True):
    from seedvr2.loading.packed import scheme_of

    def product(x, weight, bias):
        log.quantised.clear()
        out = original(x, weight, bias)
        path = scheme_of(weight.scheme).product.path
        if not compare:
            reference = _reference(path, x, weight, bias, log.quantised)[0]
            if reference.shape != out.shape:
                raise KernelCheckFailed(f"the {path} product of a {tuple(weight.shape)} layer "
                                        f"has shape {tuple(out.shape)}, its definition "
                                        f"{tuple(reference.shape)}")
            log.products[path] += 1
            log.layers[id(weight.parts[next(iter(weight.parts))])] = path
            return out
        reference, bound = _definition(path, x, weight, bias, log.quantised)
        error = (out.float() - reference).abs().max().item() if out.numel() else 0.0
        # A definition that overflows float32 (a weight of extreme magnitude) has no digits to
        # compare: the pipeline's per-batch check stops such a job.
        if math.isfinite(bound) and bool(torch.isfinite(reference).all()) and not error <= bound:
            raise KernelCheckFailed(
                f"the {path} product of a {tuple(weight.shape)} layer differs from "
                f"dequant(quant(x)) @ dequant(W).T by {error:.3g} (bound {bound:.3g})")
        log.products[path] += 1
        log.layers[id(weight.parts[next(iter(weight.parts))])] = path
        return out
    return product


def _definition(path: str, x, weight, bias, quantised) -> tuple[torch.Tensor, float]:
    """``dequant(quant(x)) @ dequant(W).T + bias`` in float32, and the bound of a correct
    product's difference from it: the float32 sums (at most K terms, 4 standard deviations of
    their rounding, u·√K·Σ|x_k w_k|) and the roundings of the output to its dtype (one, and a
    second where a bias is added after it, as the eager backend does)."""
    reference, x_deq, w = _reference(path, x, weight, bias, quantised)
    magnitude = (x_deq.abs() @ w.abs().t()).max().item() if x_deq.numel() else 0.0
    u32, u_out = torch.finfo(torch.float32).eps / 2, torch.finfo(x.dtype).eps / 2
    roundings = 1 if bias is None else 2
    bound = 4 * math.sqrt(x_deq.shape[1]) * u32 * magnitude + \
        roundings * u_out * reference.abs().max().item() + 1e-30
    return reference, bound


def _reference(path: str, x, weight, bias, quantised):
    """(``dequant(quant(x)) @ dequant(W).T + bias`` in float32 shaped as the product's
    output, the dequantised activations, the dequantised weight)."""
    x2d = x.reshape(-1, x.shape[-1])
    x_deq = _activations(path, x2d, weight, quantised)
    w = weight.dequantize(torch.float32)
    reference = torch.nn.functional.linear(x_deq, w, None if bias is None else bias.float())
    return reference.reshape(*x.shape[:-1], w.shape[0]), x_deq, w


def _activations(path, x2d, weight, quantised) -> torch.Tensor:
    """The activations as the product's quantiser rounded them, dequantised by our own
    decoders (not the kernel's)."""
    from seedvr2.loading.packed import PackedWeight

    rows, cols = x2d.shape
    if path == "int8":
        return _int8_activations(x2d, weight)
    (_, args, out), = quantised
    if path == "fp8":
        return out.float() * args["scale"].float()
    codes, scales = out
    if path == "mxfp8":
        padded = PackedWeight("mxfp8", tuple(codes.shape), {"data": codes, "scale": scales})
        return padded.dequantize(torch.float32)[:rows, :cols]
    padded = PackedWeight("nvfp4", (codes.shape[0], 2 * codes.shape[1]),
                          {"data": codes, "scale": scales, "scale_2": args["per_tensor_scale"]})
    return padded.dequantize(torch.float32)[:rows, :cols]


def _int8_activations(x2d, weight) -> torch.Tensor:
    """comfy-kitchen's int8 activations: rows quantised to 127 levels of their absmax, after
    the ConvRot rotation in x's dtype; rotated back for the unrotated weight."""
    from comfy_kitchen.backends.eager.quantization import quantize_int8_rowwise
    from seedvr2.loading.int8 import regular_hadamard

    x = x2d
    group = int(weight.params.get("group_size", 0))
    if weight.scheme == "int8_convrot":
        h = regular_hadamard(group, dtype=x.dtype, device=x.device)
        x = (x.reshape(-1, x.shape[1] // group, group) @ h).reshape(x.shape)
    codes, scale = quantize_int8_rowwise(x)
    deq = codes.float() * scale.float()
    if weight.scheme == "int8_convrot":
        h = regular_hadamard(group, device=deq.device)
        deq = (deq.reshape(-1, deq.shape[1] // group, group) @ h).reshape(deq.shape)
    return deq
