"""One host allocation holding a model's weights, each tensor a view carved from it.

Why not ``tensor.pin_memory()`` per tensor: PyTorch's caching host allocator rounds every
pinned block up to a power of two (a 7B DiT's 15.2 GiB of weights pinned ~24.8 GiB) and
keeps freed blocks cached for reuse, so ``torch.cuda.empty_cache()`` never returns them to the
system. A :class:`HostArena` allocates plain host memory once, sized to the sum of its
tensors (each rounded up only to :data:`ALIGNMENT` bytes), and pins it in place with
``cudaHostRegister``; dropping the arena unregisters and frees exactly that memory.

Pinning is injected (:data:`PinHook`): :func:`cuda_pin` on CUDA machines, anything that
records calls in tests, ``None`` for pageable memory (offload to the CPU of a CPU job, or when
pinning fails: copies from pageable memory are correct, only not asynchronous).
"""

from __future__ import annotations

import logging
import math
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


def cuda_pin(buffer: torch.Tensor) -> Optional[Callable[[], None]]:
    """Page-lock ``buffer`` with ``cudaHostRegister`` (no rounding, no caching allocator)."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    status = cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
    if int(status) != 0:
        log.warning("could not pin %s of host memory for the offloaded weights (CUDA error %s); "
                    "copies to the GPU will be synchronous", _size(nbytes), int(status))
        return None

    def unpin():
        # A copy still in flight may read these pages: wait for every device first (this
        # runs when a model is dropped, not per batch, so the wait costs nothing).
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
        cudart.cudaHostUnregister(ptr)
    return unpin


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


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
    """Host memory for tensors of the given shapes and dtypes, one view each (``views[i]``).

    The caller copies its tensors in one at a time (so each original can be freed as soon as
    it is copied) and calls :meth:`pin` once all are in. ``release()`` (or dropping the
    arena) unpins; the memory itself is freed when the last view is gone.
    """

    def __init__(self, specs: Sequence[tuple[torch.Size, torch.dtype]], device="cpu"):
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                 for shape, dtype in specs]
        offsets, _ = aligned_offsets(sizes)
        self.nbytes = _pinned_range(sizes)  # the range views live in and pinning covers
        # One page of slack so the range can start on a page boundary.
        raw = torch.empty(arena_bytes(sizes), dtype=torch.uint8, device=device)
        shift = (-raw.data_ptr()) % PAGE if raw.device.type == "cpu" else 0
        self.buffer = raw[shift: shift + self.nbytes]
        self.views = [self.buffer[o: o + n].view(dtype).view(shape)
                      for o, n, (shape, dtype) in zip(offsets, sizes, specs)]
        self.pinned = False
        self._unpin: Optional[weakref.finalize] = None

    def pin(self, hook: Optional[PinHook]):
        """Pin the whole arena once through ``hook`` (None: stay pageable)."""
        if hook is None or self.pinned or self.nbytes == 0:
            return
        unpin = hook(self.buffer)
        if unpin is not None:
            self.pinned = True
            # The finalizer holds the buffer, so the memory cannot be freed while registered.
            self._unpin = weakref.finalize(self, _release, unpin, self.buffer)
            self._unpin.atexit = False  # at exit the process's pages go anyway

    @property
    def pinned_bytes(self) -> int:
        return self.nbytes if self.pinned else 0

    def release(self):
        """Unpin now (idempotent); views stay valid as pageable memory."""
        if self._unpin is not None:
            self._unpin()
        self.pinned = False


def _release(unpin: Callable[[], None], buffer: torch.Tensor):
    unpin()
    del buffer
