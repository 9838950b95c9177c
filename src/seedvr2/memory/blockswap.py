"""BlockSwap: run a DiT whose weights do not fit on the GPU, at close to full speed.

The first ``blocks_to_swap`` transformer blocks (and, with ``swap_io_components``, the input and
output layers) live on the offload device in pinned memory. Before a swapped block runs, its
weights are on the compute device; while it runs, the *next* swapped block is already being
copied on a side CUDA stream, so copies overlap compute. After use the device copy is simply
dropped — weights never change, so nothing is copied back.

:class:`SwapSchedule` is the pure decision logic (which block to load or release when) and
keeps an event log; :class:`BlockSwap` carries it out with forward hooks. On a machine without
CUDA there is nothing to gain and BlockSwap reports itself inactive, but the same code path
can be forced on the CPU (tests do) to check the schedule and that outputs do not change.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

log = logging.getLogger("seedvr2")


@dataclass
class SwapSchedule:
    """Which swapped units are resident on the compute device around each forward.

    Units are numbered in execution order; ``swapped`` are those living off-device.
    ``before(i)`` makes unit i resident and starts prefetching the next ``prefetch`` swapped
    units; ``after(i)`` releases unit i. Every decision is appended to ``log``.
    """

    num_units: int
    swapped: frozenset
    prefetch: int = 1
    resident: set = field(default_factory=set)
    log: list = field(default_factory=list)
    max_resident: int = 0

    def _load(self, i: int, events: list):
        if i in self.swapped and i not in self.resident:
            self.resident.add(i)
            events.append(("load", i))
            self.max_resident = max(self.max_resident, len(self.resident))

    def before(self, i: int) -> list:
        events: list = []
        self._load(i, events)
        upcoming = [j for j in range(i + 1, self.num_units) if j in self.swapped][: self.prefetch]
        for j in upcoming:
            self._load(j, events)
        self.log.extend(events)
        return events

    def after(self, i: int) -> list:
        events = []
        if i in self.resident:
            self.resident.discard(i)
            events.append(("release", i))
        self.log.extend(events)
        return events


class _HostWeights:
    """One unit's weights: pinned host copies and, while resident, device copies."""

    def __init__(self, module: nn.Module, offload: torch.device, pin: bool):
        self.module = module
        self.host = {}
        for name, tensor in _tensors(module):
            host = tensor.detach().to(offload)
            self.host[name] = host.pin_memory() if pin and not host.is_pinned() else host
            _set(module, name, self.host[name])
        self.device_copy: Optional[dict] = None
        self.ready: Optional[torch.cuda.Event] = None

    def start_copy(self, device: torch.device, stream):
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.device_copy = {n: t.to(device, non_blocking=True) for n, t in self.host.items()}
            if stream is not None:
                self.ready = torch.cuda.Event()
                self.ready.record(stream)

    def activate(self, compute_stream):
        if self.ready is not None:
            compute_stream.wait_event(self.ready)
            for t in self.device_copy.values():
                t.record_stream(compute_stream)  # the allocator must not reuse it while computing
        for name, tensor in self.device_copy.items():
            _set(self.module, name, tensor)

    def drop(self):
        for name, tensor in self.host.items():
            _set(self.module, name, tensor)
        self.device_copy, self.ready = None, None


def _tensors(module: nn.Module):
    for name, p in module.named_parameters():
        yield name, p
    for name, b in module.named_buffers():
        yield name, b


def _set(module: nn.Module, name: str, tensor: torch.Tensor):
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[attr] = tensor


class BlockSwap:
    """Attach BlockSwap to a NaDiT. ``detach()`` restores plain placement on ``device``."""

    INPUT_MODULES = ("vid_in", "txt_in", "emb_in")
    OUTPUT_MODULES = ("vid_out_norm", "vid_out_ada", "vid_out")  # in execution order

    def __init__(self, model: nn.Module, blocks_to_swap: int, swap_io: bool, device: torch.device,
                 offload_device: torch.device, prefetch: int = 1, force: bool = False):
        num_blocks = len(model.blocks)
        if blocks_to_swap > num_blocks:
            log.warning("blocks_to_swap = %d exceeds the model's %d blocks; swapping all %d",
                        blocks_to_swap, num_blocks, num_blocks)
        self.blocks_to_swap = min(blocks_to_swap, num_blocks)
        self.device, self.offload = torch.device(device), torch.device(offload_device)
        self.active = force or self.device.type == "cuda"
        self.model = model
        if not self.active:
            log.info("BlockSwap inactive: the compute device is %s (it helps only on CUDA)", self.device)
            return
        present = lambda names: [n for n in names if hasattr(model, n)] if swap_io else []  # noqa: E731
        inputs, outputs = present(self.INPUT_MODULES), present(self.OUTPUT_MODULES)
        # Units in execution order: input layers, blocks, output layers.
        names = inputs + [f"blocks.{i}" for i in range(num_blocks)] + outputs
        self.units = [model.get_submodule(n) for n in names]
        swapped = set(range(len(inputs))) | set(range(len(names) - len(outputs), len(names)))
        swapped |= set(range(len(inputs), len(inputs) + self.blocks_to_swap))
        self.schedule = SwapSchedule(len(self.units), frozenset(swapped), prefetch)
        # Resident weights go to the device; swapped ones never pass through it at once.
        self._offloaded = tuple(names[i] + "." for i in swapped)
        self._move_resident(self.device)
        pin = self.device.type == "cuda" and self.offload.type == "cpu"
        self.weights = {i: _HostWeights(self.units[i], self.offload, pin) for i in sorted(swapped)}
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.hooks = []
        for i, unit in enumerate(self.units):
            self.hooks.append(unit.register_forward_pre_hook(lambda m, a, i=i: self._before(i)))
            self.hooks.append(unit.register_forward_hook(lambda m, a, o, i=i: self._after(i)))

    def _move_resident(self, device: torch.device):
        for name, tensor in list(_tensors(self.model)):
            if not name.startswith(self._offloaded) and tensor.device != device:
                _set(self.model, name, tensor.detach().to(device))

    def activate(self):
        """Bring the resident (never swapped) weights back to the compute device."""
        self._move_resident(self.device)

    def park(self):
        """Move the resident weights to the offload device too (between DiT phases)."""
        self.release_all()
        self._move_resident(self.offload)

    def _before(self, i: int):
        for event, j in self.schedule.before(i):
            self.weights[j].start_copy(self.device, self.stream)
        if i in self.weights:
            compute = torch.cuda.current_stream(self.device) if self.stream is not None else None
            self.weights[i].activate(compute)

    def _after(self, i: int):
        for event, j in self.schedule.after(i):
            self.weights[j].drop()

    def release_all(self):
        """Drop every device copy (after an error or interrupt mid-forward)."""
        if not self.active:
            return
        for i in list(self.schedule.resident):
            self.schedule.after(i)
            self.weights[i].drop()

    def detach(self):
        if not self.active:
            return
        self.release_all()
        for h in self.hooks:
            h.remove()
        self.model.to(self.device)
        self.active = False
