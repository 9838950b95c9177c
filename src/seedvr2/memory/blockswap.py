"""BlockSwap: run a DiT whose weights do not fit on the GPU, at close to full speed.

The first ``blocks_to_swap`` blocks (and, with ``swap_io_components``, the input and output layers)
live in one pinned host arena; the next swapped block is copied on a side CUDA stream while the
current one runs (at most ``prefetch`` + 1 on the GPU), a used copy dropped. :class:`SwapSchedule`
decides, :class:`BlockSwap`'s hooks act (docs/memory.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
import torch
from torch import nn

from .placement import WeightStore, default_pin

log = logging.getLogger("seedvr2")


@dataclass
class SwapSchedule:
    """Which swapped units (numbered in execution order) are on the compute device around each
    forward: ``before(i)`` makes unit i resident and prefetches the next ``prefetch`` swapped
    units, ``after(i)`` releases unit i; every decision is appended to ``log``."""

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


@dataclass(frozen=True)
class SwapRuntime:
    """How BlockSwap reaches the devices. ``force``: active off CUDA too (tests, benches);
    ``pin``: "auto" (where it pays), a pin hook or None; ``streams``: torch.cuda's Stream, Event,
    current_stream and stream (tests: a stand-in; None: torch.cuda, or synchronous copies)."""

    force: bool = False
    pin: object = "auto"
    streams: object = None


class BlockSwap:
    """Attach BlockSwap to a NaDiT (``leave()``: plain again, on the offload device); tensors shared
    by several units (the RoPE table) stay resident with the never-swapped weights."""

    INPUT_MODULES = ("vid_in", "txt_in", "emb_in")
    OUTPUT_MODULES = ("vid_out_norm", "vid_out_ada", "vid_out")  # in execution order

    def __init__(self, model: nn.Module, blocks_to_swap: int, swap_io: bool, device: torch.device,
                 offload_device: torch.device, prefetch: int = 1,
                 runtime: SwapRuntime = SwapRuntime()):
        num_blocks = len(model.blocks)
        if blocks_to_swap > num_blocks:
            log.warning("blocks_to_swap = %d exceeds the model's %d blocks; swapping all %d",
                        blocks_to_swap, num_blocks, num_blocks)
        self.blocks_to_swap = min(blocks_to_swap, num_blocks)
        self.device, self.offload = torch.device(device), torch.device(offload_device)
        self.active = runtime.force or self.device.type == "cuda"
        self.model = model
        if not self.active:
            log.info("BlockSwap inactive: the compute device is %s (it helps only on CUDA)", self.device)
            return
        present = lambda names: [n for n in names if hasattr(model, n)] if swap_io else []  # noqa: E731
        inputs, outputs = present(self.INPUT_MODULES), present(self.OUTPUT_MODULES)
        names = inputs + [f"blocks.{i}" for i in range(num_blocks)] + outputs
        self.units = [model.get_submodule(n) for n in names]
        swapped = set(range(len(inputs))) | set(range(len(names) - len(outputs), len(names)))
        swapped |= set(range(len(inputs), len(inputs) + self.blocks_to_swap))
        self.schedule = SwapSchedule(len(self.units), frozenset(swapped), prefetch)
        pin = default_pin(self.device, self.offload) if runtime.pin == "auto" else runtime.pin
        self.store = WeightStore(model, self.offload, pin)
        self.unit_entries = {i: self.store.entries_under(names[i] + ".") for i in sorted(swapped)}
        swapped_entries = set().union(*self.unit_entries.values()) if swapped else set()
        self.resident_entries = [i for i in range(len(self.store)) if i not in swapped_entries]
        self.copies: dict[int, dict] = {}  # unit -> device copies in flight or in use
        self.ready: dict[int, torch.cuda.Event] = {}
        # None: plain synchronous copies (BlockSwap forced on a device without streams).
        self.streams = runtime.streams if runtime.streams is not None else \
            (torch.cuda if self.device.type == "cuda" else None)
        self.stream = self.streams.Stream(self.device) if self.streams is not None else None
        self.resident_active = False
        self.activate()
        self.hooks = []
        for i, unit in enumerate(self.units):
            self.hooks.append(unit.register_forward_pre_hook(lambda m, a, i=i: self._before(i)))
            self.hooks.append(unit.register_forward_hook(lambda m, a, o, i=i: self._after(i)))

    @property
    def pinned_bytes(self) -> int:
        return self.store.pinned_bytes if self.active else 0

    def activate(self):
        """Bring the resident (never swapped) weights to the compute device, once."""
        if self.active and not self.resident_active:
            self.store.place(self.store.copy_to(self.resident_entries, self.device))
            self.resident_active = True

    def park(self):
        """Drop the resident weights' device copies too (between DiT phases)."""
        self.release_all()
        if self.active and self.resident_active:
            self.store.to_host(self.resident_entries)
            self.resident_active = False

    def _start_copy(self, unit: int, computed):
        """Start copying ``unit``'s weights, allocated from the compute stream's pool (reusing
        released units' blocks at once), after ``computed`` (an event on the compute stream
        after every released unit; None without streams): docs/memory.md."""
        copies = self.store.allocate(self.unit_entries[unit], self.device)
        self.copies[unit] = copies
        if self.stream is None:
            self.store.fill(copies)
            return
        with self.streams.stream(self.stream):
            self.stream.wait_event(computed)
            self.store.fill(copies)
            self.ready[unit] = self.streams.Event()
            self.ready[unit].record(self.stream)

    def _wait_for_copy(self, unit: int):  # on the compute stream, if a copy is in flight
        event = self.ready.pop(unit, None)
        if event is not None:
            self.streams.current_stream(self.device).wait_event(event)

    def _use(self, unit: int):
        self._wait_for_copy(unit)
        self.store.place(self.copies[unit])

    def _before(self, i: int):
        loads = self.schedule.before(i)
        computed = None
        if loads and self.stream is not None:
            # The compute-done event of unit i - 1 (every kernel queued so far): the copy of
            # unit i + prefetch waits for it, so at most prefetch + 1 units' copies are on the GPU.
            computed = self.streams.Event()
            computed.record(self.streams.current_stream(self.device))
        for _, j in loads:
            self._start_copy(j, computed)
        if i in self.unit_entries:
            self._use(i)

    def _after(self, i: int):
        for _, j in self.schedule.after(i):
            self._drop(j)

    def _drop(self, unit: int):
        # Copied but never used (a forward cut short): the compute stream, whose pool takes
        # the memory back now, must not reuse it while the copy may still write.
        self._wait_for_copy(unit)
        self.copies.pop(unit, None)
        self.store.to_host(self.unit_entries[unit])

    def release_all(self):
        """Drop every swapped unit's device copy (after an error or interrupt mid-forward)."""
        if not self.active:
            return
        for i in list(self.schedule.resident):
            self.schedule.after(i)
            self._drop(i)

    def leave(self):
        """Undo BlockSwap: hooks removed, every weight left on the offload device."""
        if not self.active:
            return
        self.park()
        for h in self.hooks:
            h.remove()
        self.active = False

