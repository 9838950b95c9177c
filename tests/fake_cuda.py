"""A fake ``cuda:0`` on the CPU: the branch a GPU run takes, run without a GPU (issue 42).

Inside :func:`fake_cuda` (a context manager yielding a :class:`FakeCuda`):

* tensors are fake (``torch._subclasses.fake_tensor.FakeTensorMode``): shapes, dtypes and
  devices, no data; a tensor made on ``"cuda"`` is a fake CUDA tensor, and mixing a CPU tensor
  (more than a scalar) into a CUDA operation raises, as on a GPU;
* the ``torch.cuda`` queries the code makes are answered by a stand-in of one GPU of the given
  compute capability (:data:`PRODUCTS` names it): ``is_available``, ``device_count``,
  ``get_device_capability``, ``get_device_name`` / ``get_device_properties``,
  ``mem_get_info``, ``memory_stats`` / ``memory_allocated`` / ``max_memory_allocated`` /
  ``memory_reserved`` / ``max_memory_reserved`` (from the live bytes of fake CUDA tensors,
  ``bench/memory_trace.py``'s :class:`LiveBytes`; the reserved pool grows with the peak and
  shrinks at ``empty_cache``, its unused part counted as ``inactive_split_bytes``: the
  worst case of a caching allocator), ``synchronize``, ``empty_cache``, streams and events;
  ``Tensor.pin_memory`` / ``is_pinned`` / ``record_stream``, ``torch.empty(pin_memory=True)``
  and ``cudart().cudaHostRegister``;
* every operation on a CUDA tensor, every copy between devices and every stream / event call
  is appended to :attr:`FakeCuda.log` as an :class:`Op` ``(kind, stream, detail)``, in issue
  order (kinds: ``op``, ``copy``, ``record``, ``wait_event``, ``wait_stream``, ``sync``,
  ``record_stream``, ``pin``, ``kitchen``: the backend comfy-kitchen's registry chose);
* what a GPU of that capability would refuse is appended to :attr:`FakeCuda.violations` (and
  the operation still raises where the GPU's would): an operation mixing devices, a product
  in a dtype the capability lacks (:data:`NEEDS`), and inside :meth:`FakeCuda.on_device` any
  computation on CPU tensors (a CPU-only branch taken on CUDA);
* comfy-kitchen answers as on such a GPU with a torch built for CUDA 13: its CUDA backend
  loaded (``list_backends``), so the code takes the branches that need it (the VAE's fused
  norm, fp16 accumulation), and its ops run as their registered fake implementations.

Values cannot be had: a boolean read back (``bool(t.any())``: a check for NaN) reads False,
``torch.equal`` of fake tensors False; any other read of a value raises.

Numbers that need data (times, errors, PSNR) cannot be had: the values are fake.
docs/development.md, "The fake-CUDA rehearsal".

    with fake_cuda((9, 0)) as gpu:
        x = torch.randn(4, 4, device="cuda")
        ...
    assert gpu.violations == []
    [op for op in gpu.log if op.kind == "copy"]
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple, Optional
from unittest import mock

import torch
import torch.nn.functional as F
import torch.utils._device
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from memory_trace import LiveBytes, _fused_attention  # noqa: E402

_REAL_TENSOR = torch.tensor

GIB = 1 << 30

# compute capability -> (the name torch reports, memory): one product of each; a capability
# not listed gets a generic name.
PRODUCTS = {
    (7, 5): ("Tesla T4", 15 * GIB),
    (8, 0): ("NVIDIA A100-SXM4-80GB", 79 * GIB),
    (8, 6): ("NVIDIA GeForce RTX 3090", 24 * GIB),
    (8, 9): ("NVIDIA L40S", 44 * GIB),
    (9, 0): ("NVIDIA H100 80GB HBM3", 79 * GIB),
    (10, 0): ("NVIDIA B200", 178 * GIB),
    (12, 0): ("NVIDIA GeForce RTX 5090", 31 * GIB),
}

# Products (matmuls, convolutions, attention) per dtype: the capability a GPU needs to run
# them on its tensor cores (bf16: Ampere; fp8 e4m3/e5m2: Ada; block-scaled e8m0/fp4: Blackwell).
NEEDS = {torch.bfloat16: (8, 0), torch.float8_e4m3fn: (8, 9), torch.float8_e5m2: (8, 9),
         torch.float8_e8m0fnu: (10, 0), torch.float4_e2m1fn_x2: (10, 0)}
PRODUCT_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_scaled_mm",
               "_scaled_dot_product", "conv3d", "conv2d")
# Operations that make or move tensors, not compute on them (a CPU tensor made or copied in a
# CUDA branch is only wrong where it is then used with CUDA ones: that raises).
_NOT_COMPUTE = ("empty", "zeros", "ones", "full", "arange", "_to_copy", "copy_", "clone",
                "detach", "view", "reshape", "_reshape_alias", "t.", "transpose", "permute",
                "unsqueeze", "squeeze", "expand", "slice", "select", "alias", "lift_fresh",
                "scalar_tensor", "_local_scalar_dense", "as_strided", "set_", "resize_",
                "split", "unbind", "cat", "stack", "fill_", "zero_", "normal_", "uniform_",
                "random_", "rand", "randn", "randint", "linspace", "_pin_memory", "is_pinned",
                "new_", "contiguous", "sym_", "unfold", "index_select", "narrow", "flip")


class Op(NamedTuple):
    kind: str  # op, copy, record, wait_event, wait_stream, sync, record_stream, pin, kitchen
    stream: str  # the stream it was issued on ("-" for none)
    detail: str  # the aten op, "cpu->cuda:0 pinned non_blocking 4.0 MiB", the event's name


class FakeStream:
    def __init__(self, gpu: "FakeCuda", device=None, priority: int = 0, name: str = ""):
        self.gpu = gpu
        self.stream_id = next(gpu._ids)
        self.name = name or f"stream{self.stream_id}"
        self.device = torch.device("cuda", 0)
        self.cuda_stream = self.stream_id

    def wait_event(self, event):
        self.gpu._append("wait_event", self, event.name)

    def wait_stream(self, other):
        self.gpu._append("wait_stream", self, other.name)

    def record_event(self, event=None):
        event = event or FakeEvent(self.gpu)
        event.record(self)
        return event

    def synchronize(self):
        self.gpu._append("sync", self, "stream")

    def query(self) -> bool:
        return True

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.stream_id == self.stream_id

    def __hash__(self):
        return self.stream_id

    def __repr__(self):
        return f"<fake {self.name}>"


class FakeEvent:
    def __init__(self, gpu: "FakeCuda", enable_timing=False, blocking=False, interprocess=False):
        self.gpu = gpu
        self.name = f"event{next(gpu._ids)}"
        self.recorded_on: Optional[FakeStream] = None

    def record(self, stream=None):
        self.recorded_on = stream or self.gpu.current
        self.gpu._append("record", self.recorded_on, self.name)

    def wait(self, stream=None):
        self.gpu._append("wait_event", stream or self.gpu.current, self.name)

    def synchronize(self):
        self.gpu._append("sync", self.recorded_on, self.name)

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return float("nan")  # times need a GPU


_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


def _target_device(args, kwargs):
    """The device an operation makes its result on, where it names one: a keyword (factories,
    ``_to_copy``) or, under ``torch.inference_mode`` where ``Tensor.to`` reaches the mode
    undecomposed (``aten.to.device``), a positional ``torch.device``."""
    return kwargs.get("device") or next((a for a in args if isinstance(a, torch.device)), None)


class _Recorder(LiveBytes):
    """Live bytes on the fake GPU (LiveBytes) and the log of what ran on it."""

    def __init__(self, gpu: "FakeCuda"):
        super().__init__("cuda")
        self.gpu = gpu

    def track(self, t):
        super().track(t)
        self.gpu._grow()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        self.gpu._see(func, name, flat, args, kwargs)
        if func is torch.ops.aten.equal.default and any(is_fake(t) for t in flat):
            return False  # no values to compare: equal tables are not found equal (not shared)
        if func in _READS and flat and is_fake(flat[0]) and flat[0].dtype == torch.bool:
            return False  # a check read back (any NaN? any overflow?): there is nothing to find
        device = _target_device(args, kwargs)
        if not any(is_fake(t) for t in flat) and \
                (device is None or torch.device(device).type == "cpu"):
            # Host facts on real host tensors (shape rows, metadata bytes) stay real, as on a GPU.
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        # Real host tensors meeting fake ones become fake here (as data, never as constants the
        # fake mode would fold by running the operation on a real GPU).
        args, kwargs = tree_map(lambda t: self.gpu.mode.from_tensor(t)
                                if isinstance(t, torch.Tensor) and not is_fake(t) else t,
                                (args, kwargs))
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except Exception as e:
            if "device" in str(e).lower():
                self.gpu.violations.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            raise


@dataclass
class FakeCuda:
    """One fake GPU (see the module doc)."""

    capability: tuple
    name: str
    total_memory: int
    log: list = field(default_factory=list)
    violations: list = field(default_factory=list)
    host_compute: list = field(default_factory=list)  # CPU ops seen inside on_device()

    def __post_init__(self):
        self._ids = itertools.count(1)
        self.default = FakeStream(self, name="default")
        self.current = self.default
        self.recorder = _Recorder(self)
        self.reserved = self.max_reserved = 0
        self._strict = 0
        self._pinned: set = set()

    # -- memory --------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        return self.recorder.now

    def _grow(self):
        self.reserved = max(self.reserved, self.recorder.now)
        self.max_reserved = max(self.max_reserved, self.reserved)

    def memory_stats(self, device=None) -> dict:
        gc.collect()
        return {"allocated_bytes.all.current": self.allocated,
                "allocated_bytes.all.peak": self.recorder.peak,
                "reserved_bytes.all.current": self.reserved,
                "reserved_bytes.all.peak": self.max_reserved,
                "active_bytes.all.current": self.allocated,
                "inactive_split_bytes.all.current": self.reserved - self.allocated}

    def empty_cache(self):
        gc.collect()
        self.reserved = self.recorder.now

    def reset_peaks(self, device=None):
        self.recorder.reset_peak()
        self.max_reserved = self.reserved

    def mem_get_info(self, device=None) -> tuple:
        gc.collect()
        return self.total_memory - self.reserved, self.total_memory

    # -- streams -------------------------------------------------------------------------
    def _append(self, kind: str, stream, detail: str):
        self.log.append(Op(kind, stream.name if stream is not None else "-", detail))

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:
            yield
            return
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self, device=None):
        self._append("sync", None, "device")

    # -- the checks ----------------------------------------------------------------------
    @contextlib.contextmanager
    def on_device(self):
        """Any computation on CPU tensors in here is a violation: a CPU-only branch taken."""
        self._strict += 1
        try:
            yield
        finally:
            self._strict -= 1

    def lacks(self, dtype) -> bool:
        need = NEEDS.get(dtype)
        return need is not None and tuple(self.capability) < need

    def _see(self, func, name: str, tensors: list, args, kwargs):
        cuda = [t for t in tensors if t.device.type == "cuda"]
        base = name.split(".")[0]
        if base in ("copy_", "_to_copy", "to") and tensors and self._log_copy(base, args, kwargs):
            return
        if cuda:
            self._append("op", self.current, name)
            if any(base.startswith(p) for p in PRODUCT_OPS):
                for t in cuda:
                    if self.lacks(t.dtype):
                        self.violations.append(
                            f"{name} in {str(t.dtype).removeprefix('torch.')} on capability "
                            f"{self.capability[0]}.{self.capability[1]}, which lacks it")
                        break
        elif self._strict and tensors and not base.startswith(_NOT_COMPUTE) and \
                any(t.numel() > 1 for t in tensors):
            self.host_compute.append(name)
            self.violations.append(f"{name} computed on the CPU inside a CUDA branch")

    def _log_copy(self, base, args, kwargs) -> bool:
        """Log a copy between devices; False when it stays on one."""
        if base == "copy_":
            src, to = args[1], args[0].device
        else:
            src = args[0]
            to = _target_device(args, kwargs) or src.device
        to = torch.device(to)
        if to.type == "cuda" and to.index is None:
            to = torch.device("cuda", 0)
        if not isinstance(src, torch.Tensor) or src.device == to:
            return False
        pinned = src.device.type == "cpu" and self._is_pinned(src)
        blocking = "non_blocking" if kwargs.get("non_blocking") or (
            base == "copy_" and len(args) > 2 and args[2]) else "blocking"
        size = src.numel() * src.element_size()
        self._append("copy", self.current, f"{src.device.type}->{to}"
                     f"{' pinned' if pinned else ''} {blocking} {size} B")
        return True

    # -- pinned host memory --------------------------------------------------------------
    def _key(self, t):
        return t.untyped_storage()._cdata

    def pin(self, t):
        self._pinned.add(self._key(t))
        self._append("pin", None, f"{t.numel() * t.element_size()} B")
        return t

    def _is_pinned(self, t) -> bool:
        return self._key(t) in self._pinned

    def properties(self, device=None):
        return SimpleNamespace(name=self.name, major=self.capability[0],
                               minor=self.capability[1], total_memory=self.total_memory,
                               multi_processor_count=132, is_integrated=False)


def _host_constant(data, *args, device=None, **kwargs):
    """``torch.tensor``: made real on the host (the code reads host facts as numbers), then
    moved where asked (a fake copy to the GPU)."""
    with unset_fake_temporarily():
        made = _REAL_TENSOR(data, *args, **kwargs)
    return made if device is None or torch.device(device).type == "cpu" else made.to(device)


_SWAP_TENSORS = torch.utils.swap_tensors


def _swap_fakes(t1, t2):
    """``Module.to`` swaps fake parameters, which the fake mode's own weak references forbid:
    the new tensor's data is set into the old one instead."""
    try:
        _SWAP_TENSORS(t1, t2)
    except RuntimeError:
        if not (is_fake(t1) or is_fake(t2)):
            raise
        with torch.no_grad():
            t1.data = t2.data


def _real(factory):
    def made(*args, **kwargs):
        with unset_fake_temporarily():
            return factory(*args, **kwargs)
    return made


@contextlib.contextmanager
def _kitchen_on_fakes(gpu: FakeCuda):
    """comfy-kitchen's functions that call a backend directly (``int8_linear``,
    ``quantize_int8_rowwise``, ...) run on fake tensors as its registered fake implementation of
    the same op (``torch.ops.comfy_kitchen``); the backend the registry chose for the call (as
    it chooses on a GPU) is logged as ``Op("kitchen", "-", "NAME: MODULE")``. Ops called
    through ``torch.ops`` take their fake implementations by themselves."""
    try:
        import comfy_kitchen
        from comfy_kitchen.backends.eager.quantization import DTYPE_TO_CODE
    except ImportError:
        yield
        return
    registry = comfy_kitchen.registry
    original = registry.get_implementation

    def get_implementation(func_name, backend=None, kwargs=None):
        impl = original(func_name, backend=backend, kwargs=kwargs)
        gpu._append("kitchen", None, f"{func_name}: {getattr(impl, '__module__', impl)}")
        fakes = [v for v in (kwargs or {}).values() if isinstance(v, torch.Tensor) and is_fake(v)]
        op = getattr(torch.ops.comfy_kitchen, func_name, None)
        if not fakes:
            return impl
        if op is None:
            raise RuntimeError(f"fake cuda: comfy-kitchen's {func_name} has no fake "
                               f"implementation to run on fake tensors")
        names = [a.name for a in op.default._schema.arguments]

        def fake(**kw):
            if "out_dtype" in kw and "output_dtype_code" in names:
                kw["output_dtype_code"] = DTYPE_TO_CODE[kw.pop("out_dtype")]
            return op(**{k: v for k, v in kw.items() if k in names})
        return fake

    status = comfy_kitchen.list_backends()

    def list_backends():  # as on a GPU with a torch built for CUDA 13: its CUDA backend loaded
        cuda = {**status.get("cuda", {}), "available": True, "disabled": False,
                "unavailable_reason": None,
                "capabilities": status.get("eager", {}).get("capabilities", [])}
        return {**status, "cuda": cuda}

    with mock.patch.object(registry, "get_implementation", get_implementation), \
            mock.patch.object(comfy_kitchen, "list_backends", list_backends):
        yield


def _check_device(device=None):
    index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
    if index not in (None, 0):
        raise RuntimeError(f"fake cuda: only cuda:0 exists (asked for {device})")


@contextlib.contextmanager
def fake_cuda(capability=(9, 0), *, name: Optional[str] = None,
              total_memory: Optional[int] = None):
    """A fake ``cuda:0`` of ``capability`` (see the module doc); yields its :class:`FakeCuda`.
    Tensors made inside are fake; those made before are used as constants."""
    capability = tuple(capability)
    # Imported as this machine is, before anything is patched: imported inside, comfy-kitchen
    # would keep fake module-level tables (and register backends for a GPU) for the process.
    with contextlib.suppress(ImportError):
        import comfy_kitchen  # noqa: F401
        import comfy_kitchen.backends.eager.quantization  # noqa: F401
    product, memory = PRODUCTS.get(capability, (f"NVIDIA GPU sm_{capability[0]}{capability[1]}",
                                                 80 * GIB))
    gpu = FakeCuda(capability, name or product, total_memory or memory)
    def pin_memory(self, *args, **kwargs):
        return gpu.pin(self)

    def is_pinned(self, *args, **kwargs):
        return gpu._is_pinned(self)

    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):  # pinned host memory asks the real driver
        made = real_empty(*args, **kwargs)
        return gpu.pin(made) if pin_memory else made

    def record_stream(self, stream):
        gpu._append("record_stream", stream, f"{self.numel() * self.element_size()} B")

    def host_register(ptr, nbytes, flags):
        gpu._append("pin", None, f"registered {nbytes} B")
        return 0

    cudart = SimpleNamespace(cudaHostRegister=host_register,
                             cudaHostUnregister=lambda ptr: 0)
    patches = {
        "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
        "set_device": _check_device, "is_initialized": lambda: True, "init": lambda: None,
        "get_device_capability": lambda device=None: capability,
        "get_device_name": lambda device=None: gpu.name,
        "get_device_properties": gpu.properties,
        "is_bf16_supported": lambda including_emulation=True: capability >= (8, 0),
        "mem_get_info": gpu.mem_get_info, "memory_stats": gpu.memory_stats,
        "memory_allocated": lambda device=None: gpu.allocated,
        "max_memory_allocated": lambda device=None: gpu.recorder.peak,
        "memory_reserved": lambda device=None: gpu.reserved,
        "max_memory_reserved": lambda device=None: gpu.max_reserved,
        "reset_peak_memory_stats": gpu.reset_peaks, "empty_cache": gpu.empty_cache,
        "synchronize": gpu.synchronize, "set_sync_debug_mode": lambda mode: None,
        "current_stream": lambda device=None: gpu.current,
        "default_stream": lambda device=None: gpu.default,
        "Stream": lambda device=None, priority=0, **k: FakeStream(gpu, device, priority),
        "Event": lambda *a, **k: FakeEvent(gpu, *a, **k), "stream": gpu.stream,
        "cudart": lambda: cudart,
    }
    with contextlib.ExitStack() as stack:
        # The fake mode first: made under a patched torch.cuda, it would initialise CUDA.
        gpu.mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        for attr, value in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, attr, value))
        # Host facts (shapes, metadata bytes) stay real: the code reads them as numbers.
        stack.enter_context(mock.patch.object(torch, "tensor", _host_constant))
        stack.enter_context(mock.patch.object(torch, "frombuffer", _real(torch.frombuffer)))
        # Attention allocates as the fused GPU kernels do (not as fake tensors' math fallback).
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention",
                                              _fused_attention))
        stack.enter_context(mock.patch.object(torch.Tensor, "pin_memory", pin_memory))
        # torch.device(...)'s factory table is cached on first use: filled now, it holds the
        # real torch.empty (filled under the patch, it would hold the wrapper and ignore
        # ``with torch.device("cuda")`` for every later torch.empty).
        torch.utils._device._device_constructors()
        stack.enter_context(mock.patch.object(torch, "empty", empty))
        stack.enter_context(mock.patch.object(torch.Tensor, "is_pinned", is_pinned))
        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream", record_stream))
        stack.enter_context(mock.patch.object(torch.utils, "swap_tensors", _swap_fakes))
        stack.enter_context(mock.patch.object(torch.version, "cuda", torch.version.cuda or
                                              "13.0"))
        stack.enter_context(_kitchen_on_fakes(gpu))
        stack.enter_context(gpu.recorder)
        yield gpu
