"""One host allocation holding a model's weights, each tensor a view carved from it.

Sized to the weights and pinned in place (``cudaHostRegister``; ``pin_memory()``'s caching allocator
rounds to powers of two and never gives memory back). Pinning is injected (:data:`PinHook`); where
it fails, uploads go through a small pinned :class:`PinnedStaging`; inside ComfyUI pins count in its
budget (:class:`ComfyPin`). docs/memory.md, "Weights off the GPU"; docs/comfyui.md."""

from __future__ import annotations

import logging
import math
import sys
import weakref
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger("seedvr2")

# Every view starts at a multiple of this many bytes: a multiple of every dtype's size (views
# of any dtype are legal) and of the 512-byte granularity CUDA's copy engines and PyTorch's
# device allocator use, so a host view and its device copy have the same alignment.
ALIGNMENT = 512
PAGE = 4096  # the registered range starts and ends on page boundaries: pinning works per page

# pin(buffer) pins a host uint8 buffer in place and returns the function that unpins it, or
# None when it could not pin (the buffer then stays pageable).
PinHook = Callable[[torch.Tensor], Optional[Callable[[], None]]]

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context (a DiT and VAE on two GPUs)


class CudaRuntime:
    """The CUDA runtime calls pinning makes, each returning a ``cudaError_t`` as an int.
    ``cudaGetLastError`` (None where not found) is the libcudart torch loaded, from the process's
    memory map: a failed pin's error is reset, not resurfacing after a later kernel."""

    def __init__(self):
        cudart = torch.cuda.cudart()
        self.cudaHostRegister = cudart.cudaHostRegister
        self.cudaHostUnregister = cudart.cudaHostUnregister
        self.cudaGetLastError = _loaded_runtime_call("cudaGetLastError")


def _loaded_runtime_call(name: str) -> Optional[Callable[[], int]]:
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "libcudart.so" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            function = getattr(ctypes.CDLL(path), name)  # already loaded: the same handle
        except (OSError, AttributeError):
            continue
        function.restype, function.argtypes = ctypes.c_int, []
        return function
    return None


def _not_cleared(runtime: CudaRuntime) -> str:
    """Read (and so reset) the runtime's last error; where impossible, a note for the log."""
    if runtime.cudaGetLastError is not None:
        runtime.cudaGetLastError()
        return ""
    return (" (the CUDA runtime's error state could not be reset: a later CUDA error may be "
            "this one reported again)")


def cuda_pin(buffer: torch.Tensor, device: Optional[torch.device] = None,
             runtime: Optional[CudaRuntime] = None) -> Optional[Callable[[], None]]:
    """Page-lock ``buffer`` with ``cudaHostRegister``; unpinning waits for ``device`` alone
    (``None``: the current GPU). On failure the runtime's error is reset and ``None`` returned
    (the arena then uploads through :class:`PinnedStaging`)."""
    runtime = runtime or CudaRuntime()
    ptr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    status = int(runtime.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if status != 0:
        log.warning("could not pin %s of host memory for the offloaded weights (CUDA error %s); "
                    "copies to the GPU go through a %s pinned staging buffer instead%s",
                    _size(nbytes), status, _size(STAGING_SLOTS * STAGING_CHUNK_BYTES),
                    _not_cleared(runtime))
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device

    def unpin():
        # A copy still in flight may read these pages. Every copy from this buffer goes to
        # ``device`` (on any of its streams), so waiting for that device is enough; waiting
        # for the others would create a CUDA context (~0.5 GB) on each GPU of every rank.
        torch.cuda.synchronize(device)
        status = int(runtime.cudaHostUnregister(ptr))
        if status != 0:
            log.warning("could not unpin %s of host memory (CUDA error %s): it stays "
                        "page-locked until the process ends%s", _size(nbytes), status,
                        _not_cleared(runtime))
    return unpin


def host_pin_ledger():
    """ComfyUI's ``comfy.model_management`` when ComfyUI runs this process (already imported:
    nothing is imported here), else None: the keeper of ComfyUI's pinned-memory budget."""
    mm = sys.modules.get("comfy.model_management")
    needed = ("pin_memory", "unpin_memory", "MAX_PINNED_MEMORY", "TOTAL_PINNED_MEMORY")
    return mm if mm is not None and all(hasattr(mm, name) for name in needed) else None


class ComfyPin:
    """A :data:`PinHook` pinning through ComfyUI's ``comfy.model_management`` (``ledger``), so our
    arenas count in its pinned-memory budget (docs/comfyui.md, "Pinned memory"). Its
    ``pin_memory(tensor)`` pins only within ``MAX_PINNED_MEMORY`` (<= 0: ComfyUI pins nothing) and
    in 0.3.75 takes only ``Parameter`` tensors, so the buffer is handed over as one."""

    def __init__(self, ledger, device: torch.device):
        self.ledger, self.device = ledger, device

    def enabled(self) -> bool:
        return self.ledger.MAX_PINNED_MEMORY > 0

    def room(self) -> int:
        """Bytes ComfyUI's budget has left."""
        return max(0, int(self.ledger.MAX_PINNED_MEMORY - self.ledger.TOTAL_PINNED_MEMORY))

    def __call__(self, buffer: torch.Tensor) -> Optional[Callable[[], None]]:
        ledger, device, nbytes = self.ledger, self.device, buffer.numel()
        if not ledger.pin_memory(buffer.as_subclass(torch.nn.Parameter)):
            return None

        def unpin():
            torch.cuda.synchronize(device)  # as cuda_pin's unpin: copies in flight read it
            if not ledger.unpin_memory(buffer.as_subclass(torch.nn.Parameter)):
                log.warning("ComfyUI could not unpin %s of host memory: it stays page-locked "
                            "until the process ends", _size(nbytes))
        return unpin

    def pin_what_fits(self, buffer: torch.Tensor) -> tuple[Optional[Callable[[], None]], int]:
        """Pin ``buffer`` whole, else the pages from its start that ComfyUI's budget has room
        for, saying so; returns (unpin or None, bytes pinned from the start)."""
        nbytes = buffer.numel()
        unpin = self(buffer)
        if unpin is not None:
            return unpin, nbytes
        if not self.enabled():
            log.info("ComfyUI pins no host memory (--disable-pinned-memory, or no NVIDIA or AMD "
                     "GPU): the %s of offloaded weights stay pageable, copied to the GPU "
                     "synchronously", _size(nbytes))
            return None, 0
        room = self.room() // PAGE * PAGE
        if room >= nbytes:  # refused for another reason than its budget
            log.warning("ComfyUI could not pin %s of host memory for the offloaded weights; "
                        "copies to the GPU go through a %s pinned staging buffer instead",
                        _size(nbytes), _size(STAGING_SLOTS * STAGING_CHUNK_BYTES))
            return None, 0
        unpin = self(buffer[:room]) if room else None
        pinned = room if unpin is not None else 0
        ledger = self.ledger
        log.warning("pinning %s of the %s offloaded weights: ComfyUI's pinned-memory "
                    "budget (%s) has %s left beside the %s it holds; the rest goes to the GPU "
                    "through a %s pinned staging buffer (slower uploads). Unload models to "
                    "give it room.", _size(pinned), _size(nbytes),
                    _size(int(ledger.MAX_PINNED_MEMORY)), _size(self.room() + pinned),
                    _size(int(ledger.TOTAL_PINNED_MEMORY) - pinned),
                    _size(STAGING_SLOTS * STAGING_CHUNK_BYTES))
        return unpin, pinned


# Uploads from an arena that could not be pinned go through this many pinned buffers of this
# size: host memory is copied into one while the other's DMA to the device runs.
STAGING_CHUNK_BYTES = 32 * 2**20
STAGING_SLOTS = 2


class PinnedStaging:
    """Host-to-device copies of pageable memory through ``slots`` pinned buffers of ``chunk_bytes``:
    each piece an asynchronous DMA on the current stream, the host waiting only for the copy that
    last read a buffer. ``allocate`` and ``new_event``: injectable for tests."""

    def __init__(self, chunk_bytes: int = STAGING_CHUNK_BYTES, slots: int = STAGING_SLOTS,
                 allocate: Optional[Callable[[int], torch.Tensor]] = None,
                 new_event: Optional[Callable[[], object]] = None):
        self.chunk_bytes, self.slots = chunk_bytes, slots
        self.allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self.new_event = new_event or torch.cuda.Event
        self.buffers: list[torch.Tensor] = []
        self.events: list = []
        self.next_slot = 0

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def copy(self, source: torch.Tensor, out: torch.Tensor):
        """Copy host ``source`` into the device tensor ``out`` through the pinned buffers."""
        src = source.reshape(-1).view(torch.uint8)  # the arena's views are contiguous
        dst = out.view(-1).view(torch.uint8)
        for start in range(0, src.numel(), self.chunk_bytes):
            stop = min(start + self.chunk_bytes, src.numel())
            slot = self._slot()
            self.events[slot].synchronize()  # the copy that last read this buffer is done
            staged = self.buffers[slot][: stop - start]
            staged.copy_(src[start:stop])
            dst[start:stop].copy_(staged, non_blocking=True)
            self.events[slot].record()

    def _slot(self) -> int:
        slot = self.next_slot
        self.next_slot = (slot + 1) % self.slots
        if slot == len(self.buffers):
            self.buffers.append(self.allocate(self.chunk_bytes))
            self.events.append(self.new_event())
        return slot


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def aligned_offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``nbytes`` bytes packed in order, each at a multiple of
    :data:`ALIGNMENT`, and the total bytes they span."""
    offsets, end = [], 0
    for n in nbytes:
        start = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(start)
        end = start + n
    return offsets, end


def _pinned_range(nbytes: Sequence[int]) -> int:
    _, end = aligned_offsets(nbytes)
    return -(-end // PAGE) * PAGE


def arena_bytes(nbytes: Sequence[int]) -> int:
    """Host bytes an arena for tensors of these sizes allocates (what the memory budget
    counts): the page-rounded range it pins, plus one page to align the range's start."""
    return _pinned_range(nbytes) + PAGE


class HostArena:
    """Host memory for tensors of the given shapes and dtypes, one view each (``views[i]``). The
    caller copies its tensors in one at a time (each original freed at once), then calls
    :meth:`pin`; ``release()`` (or dropping the arena) unpins; the last view frees the memory."""

    def __init__(self, specs: Sequence[tuple[torch.Size, torch.dtype]], device="cpu"):
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                 for shape, dtype in specs]
        offsets, _ = aligned_offsets(sizes)
        self.nbytes = _pinned_range(sizes)  # the range views live in and pinning covers
        raw = torch.empty(arena_bytes(sizes), dtype=torch.uint8, device=device)
        shift = (-raw.data_ptr()) % PAGE if raw.device.type == "cpu" else 0
        self.buffer = raw[shift: shift + self.nbytes]
        self.views = [self.buffer[o: o + n].view(dtype).view(shape)
                      for o, n, (shape, dtype) in zip(offsets, sizes, specs)]
        self._ends = [o + n for o, n in zip(offsets, sizes)]
        self.pinned = False
        self.pinned_upto = 0  # bytes of the buffer pinned, from its start
        self.staging: Optional[PinnedStaging] = None  # uploads when pinning failed
        self._unpin: Optional[weakref.finalize] = None

    def pin(self, hook: Optional[PinHook]):
        """Pin the whole arena once through ``hook`` (None: stay pageable); what is not pinned
        uploads through a :class:`PinnedStaging`. A :class:`ComfyPin` pins what ComfyUI's budget
        has room for, and nothing (no staging either) when ComfyUI pins nothing."""
        if hook is None or self.pinned or self.nbytes == 0:
            return
        if isinstance(hook, ComfyPin):
            unpin, self.pinned_upto = hook.pin_what_fits(self.buffer)
            if not hook.enabled():
                return  # ComfyUI pins nothing: neither do we, staging included
        else:
            unpin = hook(self.buffer)
            self.pinned_upto = self.nbytes if unpin is not None else 0
        if unpin is not None:
            self.pinned = True
            # The finalizer holds the buffer, so the memory cannot be freed while registered.
            self._unpin = weakref.finalize(self, _release, unpin, self.buffer)
            self._unpin.atexit = False  # at exit the process's pages go anyway
        if self.pinned_upto < self.nbytes:
            self.staging = PinnedStaging()

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes: the arena (or the part of it pinned) and its staging buffers."""
        staged = self.staging.pinned_bytes if self.staging is not None else 0
        return (self.pinned_upto if self.pinned else 0) + staged

    def copy_into(self, index: int, out: torch.Tensor):
        """Copy ``views[index]`` into the device tensor ``out``, asynchronously, on the current
        stream (allocate ``out`` on the stream that will read and free it)."""
        view = self.views[index]
        if self.staging is None or view.numel() == 0 or self._is_pinned(index):
            out.copy_(view, non_blocking=True)
            return
        try:
            self.staging.copy(view, out)
        except RuntimeError as error:  # not even a small buffer can be pinned
            log.warning("could not pin a staging buffer either (%s); copies to the GPU will "
                        "be synchronous", str(error).splitlines()[0])
            self.staging = None
            out.copy_(view, non_blocking=True)

    def _is_pinned(self, index: int) -> bool:
        return self.pinned and self._ends[index] <= self.pinned_upto

    def release(self):
        """Unpin now (idempotent); views stay valid as pageable memory."""
        if self._unpin is not None:
            self._unpin()
        self.pinned = False


def _release(unpin: Callable[[], None], buffer: torch.Tensor):
    unpin()
    del buffer
