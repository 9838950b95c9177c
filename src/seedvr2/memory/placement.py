"""Where a model's weights wait and how they reach the compute device.

A model that waits off its compute device or swaps blocks keeps **one persistent host copy** of
every tensor (:class:`WeightStore`, a ``memory.arena.HostArena``, pinned on CUDA machines): to the
device is an asynchronous copy, back only drops the device tensors (why safe: docs/memory.md)."""

from __future__ import annotations

import functools
import itertools
from typing import Iterable, Optional

import torch
from torch import nn

from ..errors import InputError
from ..models import set_tensor
from .arena import ComfyPin, HostArena, PinHook, arena_bytes, cuda_pin, host_pin_ledger


def named_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (shared tensors repeat)."""
    return itertools.chain(module.named_parameters(remove_duplicate=False),
                           module.named_buffers(remove_duplicate=False))


def host_copy_bytes(module: nn.Module) -> int:
    """Host bytes a :class:`WeightStore` of ``module`` holds (its arena)."""
    unique = {id(t): t for _, t in named_tensors(module)}.values()
    return arena_bytes([t.numel() * t.element_size() for t in unique])


def default_pin(compute: torch.device, host: torch.device) -> Optional[PinHook]:
    """Pin host copies only where it pays: CPU memory feeding a CUDA device (unpinning waits
    for that GPU alone); inside ComfyUI through its budget (:class:`~.arena.ComfyPin`)."""
    if compute.type != "cuda" or host.type != "cpu":
        return None
    ledger = host_pin_ledger()
    if ledger is not None:
        return ComfyPin(ledger, compute)
    return functools.partial(cuda_pin, device=compute)


def tail_parking(compute: torch.device):
    """``park(n)`` for the VAE's causal caches (``vae_int8_cache`` host): a host arena of ``n``
    int8 codes for one parked tail, pinned as weights are (:func:`default_pin`)."""
    pin = default_pin(compute, torch.device("cpu"))

    def park(n: int) -> HostArena:
        arena = HostArena([((n,), torch.int8)])
        arena.pin(pin)
        return arena
    return park


class WeightStore:
    """One persistent copy of every tensor of ``model`` on ``host`` (an arena), with its names."""

    def __init__(self, model: nn.Module, host: torch.device, pin: Optional[PinHook]):
        self.model = model
        self.host = torch.device(host)
        names: dict[int, list[str]] = {}
        first: dict[int, torch.Tensor] = {}
        for name, tensor in named_tensors(model):
            names.setdefault(id(tensor), []).append(name)
            first.setdefault(id(tensor), tensor)
        self.names: list[tuple[str, ...]] = [tuple(n) for n in names.values()]
        specs = [(t.shape, t.dtype) for t in first.values()]
        if any(t.is_meta for t in first.values()):
            raise InputError("cannot offload a model whose weights are not loaded (on meta)")
        self.arena = HostArena(specs, self.host)
        # Copy one tensor at a time and point the model at its host view right away, so each
        # original (possibly a converted copy in RAM) can be freed before the next is copied.
        for i, key in enumerate(list(first)):
            view = self.arena.views[i]
            view.copy_(first.pop(key).detach())
            self._point(i, view)
        self.arena.pin(pin)
        self.on_device: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.names)

    def _point(self, i: int, tensor: torch.Tensor):
        value = tensor
        for name in self.names[i]:
            set_tensor(self.model, name, value)
            value = self._current(name)  # the same Parameter object under every name

    def _current(self, name: str) -> torch.Tensor:
        owner_name, _, attr = name.rpartition(".")
        owner = self.model.get_submodule(owner_name) if owner_name else self.model
        return owner._parameters[attr] if attr in owner._parameters else owner._buffers[attr]

    def entries_under(self, prefix: str) -> list[int]:
        """Entries referenced only under ``prefix`` (a unit's own weights, not shared ones)."""
        return [i for i, names in enumerate(self.names) if all(n.startswith(prefix) for n in names)]

    @property
    def pinned_bytes(self) -> int:
        return self.arena.pinned_bytes

    def copy_to(self, entries: Iterable[int], device: torch.device) -> dict[int, torch.Tensor]:
        """Asynchronous device copies of ``entries`` on the current stream (not yet placed)."""
        copies = self.allocate(entries, device)
        self.fill(copies)
        return copies

    def allocate(self, entries: Iterable[int], device: torch.device) -> dict[int, torch.Tensor]:
        """Uninitialised device tensors for ``entries``, from the current stream's pool."""
        views = self.arena.views
        return {i: torch.empty(views[i].shape, dtype=views[i].dtype, device=device)
                for i in entries}

    def fill(self, copies: dict[int, torch.Tensor]):
        """Copy the host copies into tensors made by :meth:`allocate`, on the current stream."""
        for i, out in copies.items():
            self.arena.copy_into(i, out)

    def place(self, copies: dict[int, torch.Tensor]):
        """Point the model at device copies made by :meth:`copy_to`."""
        for i, tensor in copies.items():
            self.on_device[i] = tensor
            self._point(i, tensor)

    def to_host(self, entries: Iterable[int]):
        """Point ``entries`` back at their host copies, dropping the device copies."""
        for i in entries:
            if self.on_device.pop(i, None) is not None:
                self._point(i, self.arena.views[i])

    def release(self):
        """Unpin the host copy now (it is also unpinned when the store is dropped)."""
        self.arena.release()


class OffloadedModel:
    """A model that waits on ``offload`` between its phases and runs on ``device``:
    ``activate()`` uploads every weight (non-blocking), ``park()`` drops the device copies."""

    def __init__(self, model: nn.Module, device, offload, pin: Optional[PinHook]):
        self.device, self.offload = torch.device(device), torch.device(offload)
        self.store = WeightStore(model, self.offload, pin)
        self.active = False

    @property
    def pinned_bytes(self) -> int:
        return self.store.pinned_bytes

    def activate(self):
        if not self.active:
            self.store.place(self.store.copy_to(range(len(self.store)), self.device))
            self.active = True

    def park(self):
        if self.active:
            self.store.to_host(range(len(self.store)))
            self.active = False

    def release_all(self):
        self.park()

    def leave(self):
        """Undo the placement: the model left plain, its weights on the offload device."""
        self.park()
