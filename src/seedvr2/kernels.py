"""The external kernels we call, what each requires, and where each runs.

Every precondition is quoted once, here, with its source and version (``_KITCHEN_CUDA`` and the
names beside it): comfy-kitchen's CUDA backend (its asserts and its ``_build_constraints``), torch's
``_scaled_mm``, SDPA's fused kernels and the 32-bit index limit of cuDNN convolutions. The eager
backends run on any device and accept calls the GPU kernels refuse, so these rules are what a CPU
test checks every call against (tests/kernel_checks.py, docs/development.md "Kernel preconditions"),
and the dispatch (``loading.lowp``) reads them to decide what a GPU of a given platform and
capability runs. This module imports torch only: any layer may use it. comfy-kitchen is imported by
:func:`kitchen` on the first low-precision product, never with the pack."""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

log = logging.getLogger("seedvr2")

KITCHEN_VERSION = "0.2.40"
_KITCHEN_CUDA = f"comfy-kitchen {KITCHEN_VERSION}, comfy_kitchen/backends/cuda/__init__.py"
_KITCHEN_EAGER = f"comfy-kitchen {KITCHEN_VERSION}, comfy_kitchen/backends/eager/quantization.py"
_TORCH_SCALED_MM = ("torch 2.11-2.14, torch/_meta_registrations.py _check_scaled_mm_sizes and "
                    "aten/src/ATen/native/cuda/Blas.cpp _scaled_mm_out_cuda")
_TORCH_SDPA = "torch 2.11-2.14, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"
_TORCH_CONV = "torch 2.11-2.14, aten/src/ATen/native/Convolution.cpp (cuDNN path)"


@dataclass(frozen=True)
class Platform:
    """What decides which kernels a device runs: NVIDIA (``cuda``) with its compute capability
    and the CUDA version torch was built for, AMD (``rocm``: ``torch.version.hip``; its
    ``get_device_capability`` numbers are not NVIDIA's), or another device type."""

    kind: str
    capability: Optional[tuple[int, int]] = None
    torch_cuda: Optional[tuple[int, ...]] = None

    def describe(self) -> str:
        if self.kind == "cuda":
            cuda = ".".join(map(str, self.torch_cuda or ())) or "unknown"
            return f"NVIDIA compute capability {self.capability[0]}.{self.capability[1]}, " \
                   f"torch built for CUDA {cuda}"
        return "AMD ROCm" if self.kind == "rocm" else self.kind


def _version(text: Optional[str]) -> Optional[tuple[int, ...]]:
    if not text:
        return None
    return tuple(int(part) for part in str(text).split(".")[:2] if part.isdigit())


def platform_of(device: torch.device) -> Platform:
    """The platform of ``device``: the platform first (ROCm reports SM-shaped capabilities,
    MI300 9.4, RDNA3 11.x, which are not NVIDIA's), then the capability."""
    device = torch.device(device)
    if device.type != "cuda":
        return Platform(device.type)
    if getattr(torch.version, "hip", None):
        return Platform("rocm")
    return Platform("cuda", tuple(torch.cuda.get_device_capability(device)),
                    _version(torch.version.cuda))


@functools.cache
def kitchen_installed() -> bool:
    """Whether comfy-kitchen can be imported (looked up, not imported: importing it loads
    its kernels, which only a low-precision product needs)."""
    return importlib.util.find_spec("comfy_kitchen") is not None


# ComfyUI's comfy/quant_ops.py (0.3.75 and main): "if torch.version.cuda is None:
# ck.registry.disable('cuda') ... if cuda_version < (13,): ck.registry.disable('cuda')": kitchen's
# compiled CUDA kernels run with a torch built for CUDA 13+ only; below, its eager backend computes.
KITCHEN_CUDA_NEEDS = (13,)


def kitchen_cuda_backend_allowed(torch_cuda: Optional[tuple[int, ...]]) -> bool:
    return torch_cuda is not None and torch_cuda >= KITCHEN_CUDA_NEEDS


def kitchen_cuda_missing() -> Optional[str]:
    """Why comfy-kitchen's CUDA backend does not compute in this process (its compiled kernels
    did not load, or it is disabled), or None when it does."""
    status = kitchen().list_backends()
    if _computes(status, "cuda"):
        return None
    return status.get("cuda", {}).get("unavailable_reason") or "disabled"


def _computes(status: Mapping[str, Any], backend: str) -> bool:
    """Whether comfy-kitchen's ``list_backends()`` says ``backend`` loaded and is enabled."""
    entry = status.get(backend, {})
    return bool(entry.get("available")) and not entry.get("disabled")


def kitchen():
    """comfy-kitchen, imported on first use, with its CUDA backend disabled where ComfyUI
    disables it (torch not built for CUDA 13+); the log says once which backend computes."""
    import comfy_kitchen as ck

    _configure_kitchen(_version(torch.version.cuda))
    return ck


@functools.cache
def _configure_kitchen(torch_cuda) -> None:
    """Once per process (per CUDA version torch reports: the tests change it)."""
    import comfy_kitchen as ck

    why = ""
    if not kitchen_cuda_backend_allowed(torch_cuda):
        ck.disable_backend("cuda")
        built = "without CUDA" if torch_cuda is None else \
            f"for CUDA {'.'.join(map(str, torch_cuda))}"
        why = f": torch is built {built}, and its CUDA kernels need CUDA 13 or newer (ComfyUI " \
              f"disables them likewise)"
    log.info("comfy-kitchen: low-precision products computed by its %s backend%s",
             kitchen_backend(ck), why)


def kitchen_backend(ck) -> str:
    """The backend comfy-kitchen's registry picks first: the first of its priority order
    (cuda, triton, eager) that loaded here and is not disabled."""
    status = ck.list_backends()
    order = getattr(ck.registry, "_priority", ("cuda", "triton", "eager"))
    return next((name for name in order if _computes(status, name)), "eager")


@dataclass(frozen=True)
class Rule:
    """One precondition: the source's words, and a check of a call's arguments (tensors, or
    meta tensors of the same shapes) that says what is wrong, or None."""

    quote: str
    problem: Callable[[Mapping[str, Any]], Optional[str]]


@dataclass(frozen=True)
class Kernel:
    """An external kernel as we call it: ``name`` is the call (``comfy_kitchen.X``,
    ``torch.X``); ``capability`` the least NVIDIA compute capability it runs on (None: any);
    ``rocm`` whether it runs on AMD GPUs (``"kitchen"``: when comfy-kitchen registers a
    non-eager backend for it there)."""

    name: str
    source: str
    rules: tuple[Rule, ...]
    capability: Optional[tuple[int, int]] = None
    capability_quote: str = ""  # where the capability is stated, in its source's words
    rocm: object = False  # False, True or "kitchen"

    def violations(self, args: Mapping[str, Any]) -> list[str]:
        """What the call with ``args`` (parameter name -> value) breaks, each with its rule."""
        problems = ((rule, rule.problem(args)) for rule in self.rules)
        return [f"{self.name}: {problem} ({self.source}: \"{rule.quote}\")"
                for rule, problem in problems if problem]

    def runs_on(self, platform: Platform) -> Optional[str]:
        """Why this kernel does not run on ``platform``, or None."""
        if platform.kind == "cuda":
            if self.capability is not None and platform.capability < self.capability:
                return f"{self.name} needs compute capability {self.capability[0]}." \
                       f"{self.capability[1]} ({self.capability_quote})"
            return None
        if platform.kind == "rocm":
            if self.rocm == "kitchen":
                function = self.name.rpartition(".")[2]
                return None if kitchen_runs_on_rocm(function) else \
                    f"comfy-kitchen has no ROCm backend for {function} here"
            return None if self.rocm else f"{self.name} is not used on ROCm"
        return f"{self.name} needs a GPU"


def kitchen_runs_on_rocm(function: str) -> bool:
    """Whether comfy-kitchen registered a backend other than eager (hip, triton) that
    implements ``function``: what it reports available on this AMD GPU."""
    status = kitchen().list_backends()
    return any(name != "eager" and _computes(status, name) and function in backend["capabilities"]
               for name, backend in status.items())


def _tensor(args, name) -> Optional[torch.Tensor]:
    value = args.get(name)
    return value if isinstance(value, torch.Tensor) else None


def _given(*names):
    """A rule's check of the call's tensors ``names``, ``check(args, *tensors)``: it applies
    only when the call passes them all (None, nothing to say, otherwise)."""
    def wrap(check):
        def problem(args):
            tensors = [_tensor(args, name) for name in names]
            return None if any(t is None for t in tensors) else check(args, *tensors)
        return problem
    return wrap


def _contiguous(name):
    @_given(name)
    def problem(args, t):
        return None if t.is_contiguous() else f"{name} not contiguous"
    return problem


def _dtype_in(name, dtypes):
    @_given(name)
    def problem(args, t):
        return None if t.dtype in dtypes else \
            f"{name} is {t.dtype}, not one of {', '.join(str(d) for d in dtypes)}"
    return problem


def _dims(name, ndim):
    @_given(name)
    def problem(args, t):
        return None if t.dim() == ndim else f"{name} has {t.dim()} dimensions, not {ndim}"
    return problem


def _padded_rows(multiple: int, flag: str):
    @_given("x")
    def problem(args, x):
        if args.get(flag) or x.dim() != 2:
            return None
        rows, cols = x.shape
        if rows % multiple or cols % multiple:
            return f"x is {rows} x {cols}, not multiples of {multiple}, and {flag} is off"
        return None
    return problem


def tiled_scales_shape(rows: int, blocks: int) -> tuple[int, int]:
    """The block-scale matrix of ``rows`` x ``blocks`` scales in cuBLAS' 128x4 tiles."""
    return -(-rows // 128) * 128, -(-blocks // 4) * 4


def is_power_of_4(size) -> bool:
    """Whether ``size`` is 4, 16, 64, ... (an int; a bool is not a size)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 4:
        return False
    while size % 4 == 0:
        size //= 4
    return size == 1


def _block_scales(block: int, packed: bool):
    """Both operands' block scales in cuBLAS' 128x4 tiles (:func:`tiled_scales_shape`)."""
    @_given("a", "b", "block_scale_a", "block_scale_b")
    def problem(args, a, b, sa, sb):
        k = a.shape[1] * (2 if packed else 1)
        bad = []
        for name, rows, scale in (("block_scale_a", a.shape[0], sa), ("block_scale_b", b.shape[0], sb)):
            want = tiled_scales_shape(rows, -(-k // block))
            if tuple(scale.shape) != want:
                bad.append(f"{name} is {list(scale.shape)}, not {list(want)}")
        return "; ".join(bad) or None
    return problem


@_given("a", "b")
def _same_k(args, a, b):
    return None if a.shape[1] == b.shape[1] else \
        f"a is {list(a.shape)} and b {list(b.shape)}: their K differ"


def _has_values(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values to compare (meta and fake tensors have shapes only)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def _nvfp4_alpha(args):
    alpha = _tensor(args, "alpha")
    sa, sb = _tensor(args, "tensor_scale_a"), _tensor(args, "tensor_scale_b")
    if alpha is None:
        return "alpha is not given"
    if alpha.dtype != torch.float32 or alpha.numel() != 1:
        return f"alpha is {alpha.dtype} of {alpha.numel()} values, not one float32"
    if sa is not None and sb is not None and _has_values(alpha) and \
            not torch.allclose((sa.float() * sb.float()).reshape(()), alpha.reshape(()).float(),
                               rtol=0, atol=0, equal_nan=True):
        return "alpha is not tensor_scale_a * tensor_scale_b (the eager backend ignores alpha)"
    return None


@_given("weight", "x")
def _int8_weight(args, weight, x):
    scale = _tensor(args, "weight_scale")
    if x.shape[-1] != weight.shape[1]:
        return f"x has {x.shape[-1]} input features, the weight {weight.shape[1]}"
    if scale is not None and scale.numel() not in (1, weight.shape[0]):
        return f"weight_scale has {scale.numel()} values, not 1 or {weight.shape[0]}"
    return None


def _convrot_group(args):
    if not args.get("convrot"):
        return None
    group, x = args.get("convrot_groupsize"), _tensor(args, "x")
    if not is_power_of_4(group):
        return f"convrot_groupsize {group!r} is not a power of 4"
    if x is not None and x.shape[-1] % group:
        return f"convrot_groupsize {group} does not divide the {x.shape[-1]} input features"
    return None


@_given("self", "mat2")
def _scaled_mm_layout(args, a, b):
    bad = []
    if a.dim() == 2 and not (a.stride(1) == 1 and a.stride(0) >= a.shape[1]) and a.numel():
        bad.append(f"self has strides {list(a.stride())}, not row-major")
    if b.dim() == 2 and not (b.stride(0) == 1 and b.stride(1) >= b.shape[0]) and b.numel():
        bad.append(f"mat2 has strides {list(b.stride())}, not column-major")
    return "; ".join(bad) or None


@_given("x", "scale")
def _fp8_scale(args, x, scale):
    if scale.numel() == 1 and scale.device == x.device:
        return None
    return f"scale is {list(scale.shape)} on {scale.device}, not one value on x's device " \
           f"({x.device})"


@_given("x")
def _fp8_sixteens(args, x):
    if x.numel() % 16:
        return f"x has {x.numel()} elements, not a multiple of 16"
    if x.is_contiguous() and x.storage_offset() * x.element_size() % 16:  # else copied
        return f"x starts {x.storage_offset() * x.element_size()} bytes into its storage, " \
               f"not on a 16-byte boundary"
    return None


@_given("self", "mat2")
def _scaled_mm_sizes(args, a, b):
    if a.shape[1] % 16:
        return f"self is {list(a.shape)}: size(1) not divisible by 16"
    if b.shape[0] % 16 or b.shape[1] % 16:
        return f"mat2 is {list(b.shape)}: a dimension not divisible by 16"
    return None


@_given("scale_a", "scale_b")
def _scaled_mm_tensorwise(args, sa, sb):
    if sa.numel() != 1 or sb.numel() != 1:
        return None
    if sa.dtype != torch.float32 or sb.dtype != torch.float32:
        return f"scales are {sa.dtype} and {sb.dtype}, not float32"
    return None


@_given("query", "key", "value")
def _sdpa_fused(args, q, k, v):
    """Flash or memory-efficient attention can run (fp32's alignment 4: compute capability 8.0+)."""
    dims = {q.shape[-1], k.shape[-1], v.shape[-1]}
    if len(dims) != 1:
        return f"q, k, v have head dimensions {sorted(dims)}"
    (head,) = dims
    align = 8 if q.dtype in (torch.float16, torch.bfloat16) else 4
    if head > 256 or head % align:
        return f"head dimension {head} is over 256 or not a multiple of {align}"
    if args.get("attn_mask") is not None:
        return "an attention mask is given"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "the last dimension of q, k or v is not contiguous"
    return None


_INT32_ELEMENTS = 2 ** 31


@_given("input")
def _conv_index(args, x):
    weight = _tensor(args, "weight")
    if x.numel() >= _INT32_ELEMENTS:
        return f"the input has {x.numel()} elements, 2^31 or more"
    if weight is not None and x.dim() == 5 and weight.dim() == 5:
        out = x.shape[0] * weight.shape[0] * math.prod(x.shape[2:])  # an upper bound
        if out >= _INT32_ELEMENTS:
            return f"the output has up to {out} elements, 2^31 or more"
    return None


_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, *_HALF)


@_given("x", "stats")
def _norm_stats(args, x, stats):
    if x.dim() != 5:
        return None
    b, _, t = x.shape[:3]
    want = (b * t, args.get("num_groups"), 2)
    if tuple(stats.shape) != want or stats.dtype != torch.float32 or stats.device != x.device:
        return f"stats is {stats.dtype} {list(stats.shape)}, not float32 {list(want)} on x's device"
    return None


@_given("x")
def _norm_out(args, x):
    out, pad = _tensor(args, "out"), args.get("pad") or (0,) * 5
    if x.dim() != 5:
        return None
    if min(pad) < 0:
        return f"pad {list(pad)} has a negative entry"
    if out is None:
        return None
    b, c, t, h, w = x.shape
    left, right, top, bottom, front = pad
    want = (b, c, t + front, h + top + bottom, w + left + right)
    if tuple(out.shape) != want or out.dtype != x.dtype:
        return f"out is {out.dtype} {list(out.shape)}, not {x.dtype} {list(want)}"
    return None


@_given("x", "weight")
def _conv_operands(args, x, weight):
    residual = _tensor(args, "residual")
    if x.shape[1] != weight.shape[1]:
        return f"x has {x.shape[1]} channels, the weight {weight.shape[1]}"
    bias = _tensor(args, "bias")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"bias is {list(bias.shape)}, not [{weight.shape[0]}]"
    if residual is not None:
        stride = args.get("stride") or (1, 1, 1)
        stride = (stride,) * 3 if isinstance(stride, int) else tuple(stride)
        want = (x.shape[0], weight.shape[0], *((n - k) // s + 1 for n, k, s in
                                               zip(x.shape[2:], weight.shape[2:], stride)))
        if tuple(residual.shape) != want:
            return f"residual is {list(residual.shape)}, not the output's {list(want)}"
    return None


_VIEW_ELEMENTS = 2 ** 30  # our own bound on one fused-kernel input view (issue #36)


@_given("x")
def _view_size(args, x):
    return f"x has {x.numel()} elements, 2^30 or more" if x.numel() >= _VIEW_ELEMENTS else None


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("comfy_kitchen.quantize_mxfp8", _KITCHEN_CUDA, (
        Rule("assert num_rows % 32 == 0, f\"num_rows must be divisible by 32, got {num_rows}\" "
             "(and num_cols likewise) unless pad_32x", _padded_rows(32, "pad_32x")),
        Rule("assert x.is_contiguous(), \"Input tensor must be contiguous\"", _contiguous("x")),
        Rule("\"quantize_mxfp8\": x dtypes float32, float16, bfloat16, ExactDims(2)",
             lambda a: _dtype_in("x", _FLOATS)(a) or _dims("x", 2)(a)),
    ), rocm="kitchen"),
    Kernel("comfy_kitchen.scaled_mm_mxfp8", f"{_KITCHEN_EAGER} (no CUDA backend in "
           f"{KITCHEN_VERSION}: torch's block-scaled scaled_mm, BlockWise1x32, SWIZZLE_32_4_4)", (
        Rule("\"scaled_mm_mxfp8\": a, b float8_e4m3fn, ExactDims(2); block scales "
             "float8_e8m0fnu", lambda a: _dtype_in("a", (torch.float8_e4m3fn,))(a)
             or _dtype_in("b", (torch.float8_e4m3fn,))(a)
             or _dtype_in("block_scale_a", (torch.float8_e8m0fnu,))(a)
             or _dtype_in("block_scale_b", (torch.float8_e8m0fnu,))(a)),
        Rule("For blockwise scaling, scale_a should have expected_a_size elements "
             "(block_size_mn * ceil_div(m, 128) * ceil_div(num_k_blocks, 4) * 4)",
             _block_scales(32, packed=False)),
        Rule("mat1 and mat2 shapes cannot be multiplied", _same_k),
        Rule("Expected self.size(1) to be divisible by 16 ... both dimensions of mat2",
             _given("a", "b")(lambda args, a, b: None if a.shape[1] % 16 == 0 and
                              b.shape[0] % 16 == 0 else "K or N not divisible by 16")),
    ), capability=(10, 0), capability_quote=f"comfy-kitchen {KITCHEN_VERSION}, "
       f"comfy_kitchen/tensor/mxfp8.py TensorCoreMXFP8Layout: \"Requires SM >= 10.0 (Blackwell) "
       f"for hardware-accelerated matmul.\" MIN_SM_VERSION = (10, 0)", rocm=False),
    Kernel("comfy_kitchen.quantize_nvfp4", _KITCHEN_CUDA, (
        Rule("assert num_rows % 16 == 0, f\"num_rows must be divisible by 16, got {num_rows}\" "
             "(and num_cols likewise) unless pad_16x", _padded_rows(16, "pad_16x")),
        Rule("assert x.is_contiguous(), \"Input tensor must be contiguous\"", _contiguous("x")),
        Rule("\"quantize_nvfp4\": x float32, float16, bfloat16, ExactDims(2); per_tensor_scale "
             "float32", lambda a: _dtype_in("x", _FLOATS)(a) or _dims("x", 2)(a)
             or _dtype_in("per_tensor_scale", (torch.float32,))(a)),
    ), rocm="kitchen"),
    Kernel("comfy_kitchen.scaled_mm_nvfp4", _KITCHEN_CUDA, (
        Rule("\"scaled_mm_nvfp4\": a, b uint8 with DivisibleBy(dim=1, factor=16); block scales "
             "float8_e4m3fn; out_dtype float16 or bfloat16",
             lambda a: _dtype_in("a", (torch.uint8,))(a) or _dtype_in("b", (torch.uint8,))(a)
             or (None if _tensor(a, "a") is None or _tensor(a, "a").shape[1] % 16 == 0
                 else "a's packed K is not divisible by 16")
             or _dtype_in("block_scale_a", (torch.float8_e4m3fn,))(a)
             or _dtype_in("block_scale_b", (torch.float8_e4m3fn,))(a)
             or (None if a.get("out_dtype") in _HALF else "out_dtype not float16/bfloat16")),
        Rule("assert n % 8 == 0, \"B tensor must have 8 alignment in N dimension\"",
             _given("b")(lambda args, b: None if b.shape[0] % 8 == 0
                         else f"N = {b.shape[0]} is not a multiple of 8")),
        Rule("assert block_scale_a.size() == (roundup_m, roundup_sk), \"Invalid A scale shape\"",
             _block_scales(16, packed=True)),
        Rule("assert k_a == k_b, \"Matrix dimensions do not match\"", _same_k),
        Rule("assert alpha.dtype == torch.float32, \"alpha must be float32\"; assert "
             "alpha.numel() == 1", _nvfp4_alpha),
    ), capability=(10, 0), rocm=False),
    Kernel("comfy_kitchen.int8_linear", _KITCHEN_CUDA, (
        Rule("\"int8_linear\": x float32/float16/bfloat16, MinDims(2); weight int8, ExactDims(2); "
             "weight_scale float32; min_compute_capability=(7, 5)",
             lambda a: _dtype_in("x", _FLOATS)(a) or _dtype_in("weight", (torch.int8,))(a)
             or _dims("weight", 2)(a) or _dtype_in("weight_scale", (torch.float32,))(a)),
        Rule("assert k == k_w, \"Input and weight inner dimensions must match\"; INT8 weight "
             "scale must be scalar or per-output-channel", _int8_weight),
        Rule("Regular Hadamard size must be a power of 4 (comfy_kitchen/tensor/int8_utils.py "
             "_build_hadamard); ConvRot group size does not divide input features",
             _convrot_group),
    ), capability=(7, 5), capability_quote=f"{_KITCHEN_CUDA} _build_constraints: "
       f"\"int8_linear\" ... min_compute_capability=(7, 5)", rocm="kitchen"),
    Kernel("comfy_kitchen.quantize_per_tensor_fp8", _KITCHEN_CUDA, (
        Rule("\"quantize_per_tensor_fp8\": x float32/float16/bfloat16; scale float32; "
             "output_type float8_e4m3fn or float8_e5m2",
             lambda a: _dtype_in("x", _FLOATS)(a) or _dtype_in("scale", (torch.float32,))(a)),
        Rule("ops/per_tensor_quantize.cu: const float* scale_f = static_cast<const float*>"
             "(scale.data); ... / *scale_f (each thread reads one float32 on the GPU)",
             _fp8_scale),
        Rule("ops/per_tensor_quantize.cu: idx *= kE4M3Alignment; if (idx >= size) return; "
             "... *reinterpret_cast<const float4*>(src + idx + i * n_src_load) (16 values per "
             "thread, float4 loads and stores)", _fp8_sixteens),
    ), rocm="kitchen"),
    Kernel("torch._scaled_mm", _TORCH_SCALED_MM, (
        Rule("self must be row_major ... mat2 must be col_major", _scaled_mm_layout),
        Rule("Expected self.size(1) to be divisible by 16 ... Expected both dimensions of mat2 "
             "to be divisible by 16", _scaled_mm_sizes),
        Rule("For tensorwise scaling, both scale_a and scale_b must be float (fp32) tensors.",
             _scaled_mm_tensorwise),
    ), capability=(8, 9), capability_quote="aten/src/ATen/native/cuda/Blas.cpp: \"torch._scaled_mm "
       "is only supported on CUDA devices with compute capability >= 9.0 or 8.9, or ROCm MI300+\"",
       rocm=False),
    Kernel("torch.nn.functional.scaled_dot_product_attention", _TORCH_SDPA, (
        Rule("Flash attention requires q,k,v to have the same last dimension and to be less "
             "than or equal to 256 (check_head_dim_size_flash); the memory-efficient kernel's "
             "last dimension a multiple of minimum_gemm_alignment (8 for fp16/bf16, 4 for "
             "fp32); both refuse attn_mask and a strided last dimension", _sdpa_fused),
    ), rocm=True),
    Kernel("comfy_kitchen.group_norm_silu_pad3d", _KITCHEN_CUDA, (
        Rule("\"group_norm_silu_pad3d\": x dtypes float16, bfloat16, ExactDims(5); weight, bias "
             "float32, float16, bfloat16 or None",
             lambda a: _dtype_in("x", _HALF)(a) or _dims("x", 5)(a)
             or _dtype_in("weight", _FLOATS)(a) or _dtype_in("bias", _FLOATS)(a)),
        Rule("raise ValueError(f\"group_norm_silu_pad3d: stats must be float32 [{b * t}, "
             "{num_groups}, 2] on {x.device}\")", _norm_stats),
        Rule("raise ValueError(\"group_norm_silu_pad3d: padding must be non-negative\"); "
             "out must be (b, c, t + front, h + top + bottom, w + left + right) in x's dtype",
             _norm_out),
        Rule("x at most 2^30 elements per call (ours: the kernel indexes frame windows of the "
             "whole tensor with 32-bit strides)", _view_size),
    ), rocm="kitchen"),
    Kernel("comfy_kitchen.fp16_conv3d", _KITCHEN_CUDA, (
        Rule("\"fp16_conv3d\": x, weight float16, ExactDims(5); bias, residual float16 or None",
             lambda a: _dtype_in("x", (torch.float16,))(a) or _dims("x", 5)(a)
             or _dtype_in("weight", (torch.float16,))(a) or _dims("weight", 5)(a)
             or _dtype_in("bias", (torch.float16,))(a)
             or _dtype_in("residual", (torch.float16,))(a)),
        Rule("weight.shape[1] == c; bias.shape == (k,); residual.shape == (n, k, z, p, q) "
             "(zero padding only: x comes padded)", _conv_operands),
        Rule("any(s > 2**31 - 1 for s in strides): return None (\"a frame window carries the "
             "whole tensor's, which may not fit the kernel's 32-bit strides\"; ours: x under "
             "2^30 elements)", _view_size),
    ), rocm="kitchen"),
    Kernel("torch.nn.functional.conv3d", _TORCH_CONV, (
        Rule("Expected canUse32BitIndexMath(input) && canUse32BitIndexMath(output) to be true "
             "(cuDNN indexes with 32 bits; older cuDNN takes a slow path above)", _conv_index),
    ), rocm=True),
)}


def first_violation(name: str, args: Mapping[str, Any]) -> Optional[str]:
    """The first rule a call of the kernel ``name`` with ``args`` breaks, or None."""
    return next(iter(KERNELS[name].violations(args)), None)


def runs_on(names, platform: Platform) -> Optional[str]:
    """Why the kernels ``names`` do not all run on ``platform``, or None."""
    for name in names:
        reason = KERNELS[name].runs_on(platform)
        if reason:
            return reason
    return None
