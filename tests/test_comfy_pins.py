"""Our page-locked host memory inside ComfyUI's pinned-memory budget: an offloaded model's
arena pins through ComfyUI's own ``pin_memory``/``unpin_memory`` (so it counts in
``TOTAL_PINNED_MEMORY``), is capped by what ``MAX_PINNED_MEMORY`` has left, and says so.

ComfyUI pins only with a CUDA device, so its accounting is a stand-in here, written after
``comfy/model_management.py`` (0.3.75 and the current release): no CUDA call, the same rules."""

from __future__ import annotations

import logging
from types import ModuleType

import pytest
import torch

from seedvr2.loading import load_dit
from seedvr2.memory.arena import PAGE, STAGING_CHUNK_BYTES, STAGING_SLOTS, ComfyPin
from seedvr2.memory.placement import WeightStore, default_pin, host_copy_bytes, named_tensors

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


class ComfyPinnedMemory(ModuleType):
    """comfy.model_management's pinned-memory ledger: ``pin_memory`` takes a contiguous CPU
    tensor of an allowed type (0.3.75: Parameter or QuantizedTensor) while the total stays
    within MAX_PINNED_MEMORY, and counts it; ``unpin_memory`` takes back exactly what it
    counted (warning, and refusing, otherwise)."""

    PINNING_ALLOWED_TYPES = {"Parameter", "QuantizedTensor"}

    def __init__(self, max_pinned: int, already: int = 0):
        super().__init__("comfy.model_management")
        self.MAX_PINNED_MEMORY, self.TOTAL_PINNED_MEMORY = max_pinned, already
        self.PINNED_MEMORY: dict[int, int] = {}

    def pin_memory(self, tensor) -> bool:
        if self.MAX_PINNED_MEMORY <= 0 or type(tensor).__name__ not in self.PINNING_ALLOWED_TYPES:
            return False
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return False
        size = tensor.numel() * tensor.element_size()
        if self.TOTAL_PINNED_MEMORY + size > self.MAX_PINNED_MEMORY:
            return False
        self.PINNED_MEMORY[tensor.data_ptr()] = size  # (cudaHostRegister there)
        self.TOTAL_PINNED_MEMORY += size
        return True

    def unpin_memory(self, tensor) -> bool:
        size = tensor.numel() * tensor.element_size()
        if self.PINNED_MEMORY.get(tensor.data_ptr()) != size:
            return False
        self.TOTAL_PINNED_MEMORY -= self.PINNED_MEMORY.pop(tensor.data_ptr())
        return True


@pytest.fixture
def model(conformance):
    return load_dit(conformance / "dit3b_tiny" / "weights.safetensors")


def _inside_comfyui(monkeypatch, ledger: ComfyPinnedMemory) -> list:
    import sys

    monkeypatch.setitem(sys.modules, "comfy.model_management", ledger)
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    return synchronized


def _staging_on_the_cpu(monkeypatch):
    """Staging buffers and their events as a CPU run can have them (the copies are real)."""
    from seedvr2.memory import arena

    class Event:
        def synchronize(self):
            pass

        def record(self):
            pass
    original = arena.PinnedStaging
    monkeypatch.setattr(arena, "PinnedStaging", lambda: original(
        allocate=lambda n: torch.empty(n, dtype=torch.uint8), new_event=Event))


def test_the_arena_counts_in_comfyuis_pinned_memory(model, monkeypatch):
    ledger = ComfyPinnedMemory(max_pinned=1 << 40, already=5 * PAGE)
    synchronized = _inside_comfyui(monkeypatch, ledger)
    pin = default_pin(CUDA, CPU)
    assert isinstance(pin, ComfyPin)
    store = WeightStore(model, CPU, pin)
    arena = store.arena
    assert arena.pinned and arena.staging is None
    assert ledger.PINNED_MEMORY == {arena.buffer.data_ptr(): arena.nbytes}
    assert ledger.TOTAL_PINNED_MEMORY == 5 * PAGE + arena.nbytes == 5 * PAGE + store.pinned_bytes
    store.release()  # ComfyUI's unpin_memory, after the compute device's copies are done
    assert (ledger.TOTAL_PINNED_MEMORY, ledger.PINNED_MEMORY) == (5 * PAGE, {})
    assert synchronized == [CUDA]


def test_pinning_is_capped_by_what_comfyuis_budget_has_left(model, monkeypatch, caplog):
    expected = {n: t.clone() for n, t in named_tensors(model)}
    already = 3 * PAGE + 100
    room = (host_copy_bytes(model) - PAGE) // 2 + 123  # about half the arena
    ledger = ComfyPinnedMemory(max_pinned=already + room, already=already)
    _inside_comfyui(monkeypatch, ledger)
    _staging_on_the_cpu(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="seedvr2"):
        store = WeightStore(model, CPU, default_pin(CUDA, CPU))
    arena = store.arena
    # The part that fits, in whole pages, from the start; never past ComfyUI's maximum.
    pinned = room // PAGE * PAGE
    assert arena.pinned and arena.pinned_upto == pinned < arena.nbytes
    assert ledger.TOTAL_PINNED_MEMORY == already + pinned <= ledger.MAX_PINNED_MEMORY
    from seedvr2.memory.arena import _size as size
    assert (f"pinning {size(pinned)} of the {size(arena.nbytes)} offloaded weights: "
            f"ComfyUI's pinned-memory budget ({size(ledger.MAX_PINNED_MEMORY)}) has "
            f"{size(room)} left beside the {size(already)} it holds; the rest goes "
            f"to the GPU through a {size(STAGING_SLOTS * STAGING_CHUNK_BYTES)} pinned staging "
            f"buffer (slower uploads). Unload models to give it room.") in caplog.text
    # Every tensor reaches the device whole: the pinned ones directly, the others staged.
    copies = store.copy_to(range(len(store)), CPU)
    store.place(copies)
    assert all(torch.equal(t, expected[n]) for n, t in named_tensors(model))
    staged = [i for i in range(len(store)) if not arena._is_pinned(i) and arena.views[i].numel()]
    assert staged and len(staged) < len(store)
    store.release()
    assert ledger.TOTAL_PINNED_MEMORY == already


def test_nothing_is_pinned_when_comfyui_pins_nothing(model, monkeypatch, caplog):
    """--disable-pinned-memory (or no NVIDIA/AMD GPU): MAX_PINNED_MEMORY is -1; ours pin
    nothing either, staging included, and the log says so."""
    ledger = ComfyPinnedMemory(max_pinned=-1)
    _inside_comfyui(monkeypatch, ledger)
    with caplog.at_level(logging.INFO, logger="seedvr2"):
        store = WeightStore(model, CPU, default_pin(CUDA, CPU))
    assert not store.arena.pinned and store.arena.staging is None and store.pinned_bytes == 0
    assert ledger.TOTAL_PINNED_MEMORY == 0
    assert "ComfyUI pins no host memory (--disable-pinned-memory" in caplog.text


def test_outside_comfyui_the_arena_pins_by_itself(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "comfy.model_management", raising=False)
    assert not isinstance(default_pin(CUDA, CPU), ComfyPin)
    assert default_pin(CPU, CPU) is None


def test_a_refusal_with_room_left_is_not_called_a_full_budget(model, monkeypatch, caplog):
    """ComfyUI refusing for its own reasons (here: a release that pins no such tensor type)
    while its budget has room: said as such; uploads go through the staging buffer."""
    ledger = ComfyPinnedMemory(max_pinned=1 << 40)
    ledger.PINNING_ALLOWED_TYPES = set()
    _inside_comfyui(monkeypatch, ledger)
    with caplog.at_level(logging.WARNING, logger="seedvr2"):
        store = WeightStore(model, CPU, default_pin(CUDA, CPU))
    assert not store.arena.pinned and store.arena.staging is not None
    assert ledger.TOTAL_PINNED_MEMORY == 0
    assert "ComfyUI could not pin" in caplog.text and "budget" not in caplog.text


def test_parked_vae_tails_pin_through_comfyui_at_their_own_size(monkeypatch):
    """vae_int8_cache host: each parked causal tail is a host arena pinned through ComfyUI
    (counted in its budget at its page-rounded size, given back when the cache lets it go),
    not a block of torch's pinned caching allocator (a 1.07 GB tail pinned 2 GiB there,
    uncounted, never returned)."""
    import gc

    from seedvr2.memory.placement import tail_parking

    ledger = ComfyPinnedMemory(1 << 30)
    _inside_comfyui(monkeypatch, ledger)

    def caching_allocator(*args, **kwargs):
        raise AssertionError("pinned through torch's caching allocator")
    monkeypatch.setattr(torch.Tensor, "pin_memory", caching_allocator)
    n = 3 * 2**20 + 1  # int8 codes of one tail
    parked = tail_parking(CUDA)(n)
    assert parked.views[0].shape == (n,) and parked.views[0].dtype == torch.int8
    assert ledger.TOTAL_PINNED_MEMORY == -(-n // PAGE) * PAGE
    del parked
    gc.collect()
    assert ledger.TOTAL_PINNED_MEMORY == 0
