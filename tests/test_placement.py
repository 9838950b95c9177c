"""Weight placement checked without a GPU: ``meta`` stands in for the CUDA device, so every
tensor's device after BlockSwap / offload steps shows where a CUDA run would find it, and
pinning is an injected hook that records what it was asked to pin."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from seedvr2.loading import load_dit, load_vae
from seedvr2.memory.arena import ALIGNMENT, PAGE, HostArena, aligned_offsets, arena_bytes
from seedvr2.memory.blockswap import BlockSwap, SwapRuntime
from seedvr2.memory.placement import OffloadedModel, named_tensors
from seedvr2.models.packing import Packing
from seedvr2.models.rope import FrequencyTable, MMRoPE3d, PixelRoPE3d

META, CPU = torch.device("meta"), torch.device("cpu")


class RecordingPin:
    """A pin hook: remembers each buffer it pinned and each unpin."""

    def __init__(self):
        self.pinned: list[tuple[int, int]] = []  # (data_ptr, bytes)
        self.unpinned = 0

    def __call__(self, buffer: torch.Tensor):
        self.pinned.append((buffer.data_ptr(), buffer.numel()))

        def unpin():
            self.unpinned += 1
        return unpin


def _off_device(module, names=None) -> list[str]:
    return [n for n, t in named_tensors(module) if t.device != META and (names is None or n in names)]


@pytest.mark.parametrize("family", ["dit3b_tiny", "dit7b_tiny"])
@pytest.mark.parametrize("blocks, swap_io", [(1, False), (2, True), (0, True)])
def test_blockswap_every_tensor_a_unit_reads_is_on_the_compute_device(conformance, family,
                                                                      blocks, swap_io):
    """Run BlockSwap's hooks in execution order with meta as the compute device: whenever a
    unit runs, every tensor it reads (shared RoPE tables included) is on that device."""
    model = load_dit(conformance / family / "weights.safetensors")
    pin = RecordingPin()
    swap = BlockSwap(model, blocks, swap_io, META, CPU, runtime=SwapRuntime(True, pin))
    # The never-swapped layers are on the device before the first unit runs.
    unit_names = {n for u in swap.units for n, _ in named_tensors(u)}
    outside = [n for n, t in named_tensors(model)
               if not any(n.startswith(p + ".") for p in _unit_prefixes(swap)) and t.device != META]
    assert outside == []
    for i, unit in enumerate(swap.units):
        swap._before(i)
        assert _off_device(unit) == [], f"unit {i} would read host tensors on the GPU"
        swap._after(i)
    # Between units, swapped weights are back on the host; the shared table stayed put.
    tables = {id(b.attn.rope.rope.freqs) for b in model.blocks}
    assert len(tables) == 1 and model.blocks[0].attn.rope.rope.freqs.device == META
    assert unit_names  # the check above looked at something
    assert len(pin.pinned) == 1  # one arena for the whole model

    swap.park()
    assert all(t.device == CPU for _, t in named_tensors(model))
    swap.activate()
    for i in range(len(swap.units)):
        swap._before(i)
        assert _off_device(swap.units[i]) == []
        swap._after(i)


class RecordingStreams:
    """torch.cuda's Stream, Event, current_stream and stream as BlockSwap uses them: each
    stream keeps the queue of what was issued on it, for a simulated GPU to run."""

    def __init__(self):
        self.compute = RecordingStreams.Queue("compute")
        self.current = self.compute
        self.copy_streams: list = []

    class Queue:
        def __init__(self, name):
            self.name, self.queue = name, []

        def wait_event(self, event):
            self.queue.append(("wait", event))

    def Stream(self, device):  # noqa: N802 (torch.cuda's name)
        stream = RecordingStreams.Queue("copy")
        self.copy_streams.append(stream)
        return stream

    def Event(self):  # noqa: N802
        streams = self

        class Event:
            def record(self, stream=None):
                (stream or streams.current).queue.append(("record", self))
        return Event()

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


def _run_on_simulated_gpu(compute: list, copy: list, swapped) -> int:
    """Run two stream queues the way a GPU may: the copy stream as far ahead as its waits
    allow (the worst case for memory), the compute stream one operation at a time. Returns
    the most swapped units whose copy had started and whose compute had not finished."""
    recorded, copied, computed = set(), set(), set()
    at = {"compute": 0, "copy": 0}
    queues = {"compute": compute, "copy": copy}
    most = 0

    def step(name) -> bool:
        op = queues[name][at[name]] if at[name] < len(queues[name]) else None
        if op is None or (op[0] == "wait" and op[1] not in recorded):
            return False
        kind, what = op
        if kind == "record":
            recorded.add(what)
        elif kind == "copy":
            copied.add(what)
        elif kind == "compute":
            assert what not in swapped or what in copied, f"unit {what} ran before its copy"
            computed.add(what)
        at[name] += 1
        return True
    while at["compute"] < len(compute) or at["copy"] < len(copy):
        while step("copy"):
            most = max(most, len(copied - computed))
        assert step("compute"), "the streams wait for each other: deadlock"
    return most


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("blocks, swap_io", [(4, True), (2, True), (3, False)])
def test_blockswap_bounds_the_units_on_the_gpu_when_the_host_runs_ahead(
        conformance, prefetch, blocks, swap_io):
    """With no host syncs the host queues every unit's work before the GPU has run the first:
    a copy stream that never waits for compute copied every swapped unit at once. The copy of
    unit j must wait for the compute of unit j - prefetch - 1, so at most prefetch + 1 units
    are on the GPU at any time, and each unit runs after its copy."""
    model = load_dit(conformance / "dit7b_tiny" / "weights.safetensors")  # 4 blocks
    streams = RecordingStreams()
    swap = BlockSwap(model, blocks, swap_io, META, CPU, prefetch,
                     SwapRuntime(True, None, streams))
    (copy,) = streams.copy_streams
    unit_of = {tuple(entries): unit for unit, entries in swap.unit_entries.items()}
    fill = swap.store.fill

    def recorded_fill(copies):
        streams.current.queue.append(("copy", unit_of[tuple(copies)]))
        fill(copies)
    swap.store.fill = recorded_fill
    host_resident = []
    for _ in range(2):  # two forwards back to back, all queued before the GPU runs any
        for i in range(len(swap.units)):
            swap._before(i)
            host_resident.append(len(swap.copies))
            streams.compute.queue.append(("compute", i))
            swap._after(i)
    assert max(host_resident) == min(prefetch + 1, len(swap.schedule.swapped))
    swapped = swap.schedule.swapped
    # The order of waits. Where every unit is swapped, the c-th copy (unit j = c mod units,
    # forward f) waits for an event recorded after c - prefetch - 1 computes: the compute of
    # unit j - prefetch - 1, or at the start of a forward, of every unit queued before it.
    if len(swapped) == len(swap.units):
        n = len(swap.units)
        copies = [k for k, op in enumerate(copy.queue) if op[0] == "copy"]
        assert len(copies) == 2 * n
        for c, k in enumerate(copies):
            wait = next(w for w in reversed(copy.queue[:k]) if w[0] == "wait")
            at = streams.compute.queue.index(("record", wait[1]))
            computes = sum(op[0] == "compute" for op in streams.compute.queue[:at])
            assert computes == max(c - prefetch, c // n * n), (c, computes)
    most = _run_on_simulated_gpu(streams.compute.queue, copy.queue, swapped)
    assert most == min(prefetch + 1, len(swapped))


def test_blockswap_cut_short_keeps_an_unused_copy_until_it_is_written(conformance):
    """A forward stopped after a prefetch (an error, an interrupt): the prefetched unit's
    memory goes back to the compute stream's pool, so the compute stream first waits for the
    copy still writing into it."""
    model = load_dit(conformance / "dit7b_tiny" / "weights.safetensors")
    streams = RecordingStreams()
    swap = BlockSwap(model, 4, True, META, CPU, runtime=SwapRuntime(True, None, streams))
    (copy,) = streams.copy_streams
    swap._before(0)  # unit 0 in use (its copy waited for), unit 1 prefetched
    ready = [op[1] for op in copy.queue if op[0] == "record"]
    assert streams.compute.queue[-1] == ("wait", ready[0])
    swap.release_all()
    assert streams.compute.queue[-1] == ("wait", ready[1]) and swap.ready == {}
    assert swap.copies == {}


def _unit_prefixes(swap) -> list[str]:
    return [name for name, m in swap.model.named_modules() if any(m is u for u in swap.units)]


def test_blockswap_forward_on_cpu_with_distinct_tables(conformance):
    """A model whose blocks hold different RoPE tables (nothing shared) swaps each block's
    own table with it; the forward still matches the unswapped model exactly."""
    from conftest import load_case

    folder = conformance / "dit7b_tiny"
    case = load_case(folder, "video_ragged")
    plain = load_dit(folder / "weights.safetensors")
    swapped = load_dit(folder / "weights.safetensors")
    for model in (plain, swapped):
        for k, block in enumerate(model.blocks):
            table = block.attn.rope.rope
            table.freqs = table.freqs * (1 + k / 8)
            table.table_id = 1000 + k
    swap = BlockSwap(swapped, 3, True, CPU, CPU, runtime=SwapRuntime(True, None))
    with torch.no_grad():
        expected = plain(case["inputs.vid"], case["inputs.txt"], case["inputs.vid_shape"],
                         case["inputs.txt_shape"], case["inputs.timestep"])
        out = swapped(case["inputs.vid"], case["inputs.txt"], case["inputs.vid_shape"],
                      case["inputs.txt_shape"], case["inputs.timestep"])
    assert torch.equal(out, expected)
    assert swap.schedule.resident == set()


@pytest.mark.parametrize("rope_class", [MMRoPE3d, PixelRoPE3d])
def test_rope_cache_is_keyed_by_table_not_address(rope_class):
    """Placement code gives tables fresh device copies, and a freed copy's address is reused
    by the next: a second table at the first one's address must not get its rotations."""
    first, second = (rope_class(48, 48) if rope_class is MMRoPE3d else rope_class(48)
                     for _ in range(2))
    packing = Packing([(2, 4, 6)], [3], CPU)
    layout = packing.layout("720pwin_by_size_bysize", (1, 1, 1))
    txt_lens = packing.txt_lens_tensor()
    storage = first.rope.freqs
    cached = first.video_rotation(layout, txt_lens)
    # The second table's values land in the memory the first one used.
    storage.copy_(storage * 3)
    second.rope.freqs = storage
    expected = rotation_of(second, layout, txt_lens)
    assert not torch.equal(expected, cached)
    assert torch.equal(second.video_rotation(layout, txt_lens), expected)


def rotation_of(rope, layout, txt_lens):
    from seedvr2.models.rope import _axis_angles, rotation

    return rotation(_axis_angles(rope.video_positions(layout, txt_lens), rope.rope.freqs),
                    rope.head_dim)


def test_equal_tables_share_one_id_and_distinct_ones_do_not():
    a, b, c = (FrequencyTable(torch.arange(4.0)) for _ in range(3))
    c.freqs = c.freqs + 1
    holder = torch.nn.ModuleList([a, b, c])
    from seedvr2.models.rope import share_equal_tables

    share_equal_tables(holder)
    assert a.table_id == b.table_id != c.table_id
    assert a.freqs is b.freqs and c.freqs is not a.freqs


# --------------------------------------------------------------------------------------------
# The host arena


def test_arena_layout_alignment_and_views():
    specs = [((3, 5), torch.float16), ((), torch.float32), ((7,), torch.uint8),
             ((2, 2), torch.float64), ((0,), torch.bfloat16)]
    sizes = [30, 4, 7, 32, 0]
    offsets, end = aligned_offsets(sizes)
    assert offsets == [0, 512, 1024, 1536, 2048] and end == 2048
    # Exact sizes rounded to a page, plus a page to align the start; not a power of two.
    assert arena_bytes(sizes) == 2 * PAGE
    arena = HostArena(specs)
    assert arena.buffer.data_ptr() % PAGE == 0
    for view, (shape, dtype), offset in zip(arena.views, specs, offsets):
        assert view.shape == shape and view.dtype == dtype
        if view.numel() == 0:
            continue  # an empty tensor has no address
        assert view.data_ptr() - arena.buffer.data_ptr() == offset
        assert view.data_ptr() % ALIGNMENT == 0
    for i, view in enumerate(arena.views):
        view.fill_(i + 1) if view.dtype != torch.uint8 else view.fill_(200 + i)
    assert torch.equal(arena.views[0], torch.full((3, 5), 1, dtype=torch.float16))
    assert arena.views[1].item() == 2 and arena.views[3].sum().item() == 16  # no overlaps


def test_arena_of_a_model_is_its_size_not_a_power_of_two(conformance):
    model = load_dit(conformance / "dit7b_tiny" / "weights.safetensors")
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for _, t in named_tensors(model)}.values())
    count = len({id(t) for _, t in named_tensors(model)})
    pin = RecordingPin()
    placed = OffloadedModel(model, META, CPU, pin)
    assert pin.pinned == [(placed.store.arena.buffer.data_ptr(), placed.store.arena.nbytes)]
    # Each tensor rounds up to ALIGNMENT at most, the whole to one page.
    assert weights <= placed.pinned_bytes <= weights + count * ALIGNMENT + PAGE
    assert placed.pinned_bytes < 1.05 * weights


def test_pinned_arena_is_released_when_the_model_is_dropped(tiny_options):
    pin = RecordingPin()
    model = load_vae(tiny_options["vae"])
    placed = OffloadedModel(model, META, CPU, pin)
    placed.activate()
    assert pin.unpinned == 0
    del model, placed
    gc.collect()
    assert pin.unpinned == 1


def test_model_cache_drop_releases_the_pinned_arena(tiny_options, monkeypatch):
    """A cached, offloaded model pins once; evicting it from the cache unpins."""
    from seedvr2.api import load_models
    from seedvr2.memory import MODEL_CACHE
    from seedvr2.options import resolve_options
    from seedvr2.pipeline import model_loading

    pin = RecordingPin()
    monkeypatch.setattr(model_loading, "default_pin", lambda compute, host: pin)
    MODEL_CACHE.clear()
    opts = resolve_options(device="cpu", dtype="fp32", cache_vae=True, vae_offload_device="cpu",
                           text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))
    models = load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                         model_dir=tiny_options["model_dir"])
    again = load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                        model_dir=tiny_options["model_dir"])
    assert again.vae_placement is models.vae_placement and len(pin.pinned) == 1
    del models, again
    MODEL_CACHE.drop("vae")
    assert pin.unpinned == 1
    # A changed setting evicts the cached model: its pinned copy goes before the new load.
    first = load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                        model_dir=tiny_options["model_dir"])
    pinned_before = pin.unpinned
    del first
    load_models(tiny_options["dit"], tiny_options["vae"], opts=opts.replace(vae_offload_device="none"),
                model_dir=tiny_options["model_dir"])
    assert pin.unpinned == pinned_before + 1
    MODEL_CACHE.clear()


class FakeRuntime:
    """A CUDA runtime whose pin and unpin calls return the given errors and that keeps the
    thread's last error as the real one does: set by a failed call, reset when read."""

    def __init__(self, register=0, unregister=0, can_read_error=True):
        self.statuses = {"register": register, "unregister": unregister}
        self.last_error = 0
        self.calls: list[str] = []
        self.cudaGetLastError = self._get_last_error if can_read_error else None

    def _call(self, name):
        self.calls.append(name)
        status = self.statuses[name]
        self.last_error = status or self.last_error
        return status

    def cudaHostRegister(self, ptr, nbytes, flags):
        return self._call("register")

    def cudaHostUnregister(self, ptr):
        return self._call("unregister")

    def _get_last_error(self):
        self.calls.append("get_last_error")
        error, self.last_error = self.last_error, 0
        return error


def _failing_pin(runtime):
    from seedvr2.memory.arena import cuda_pin

    return lambda buffer: cuda_pin(buffer, torch.device("cuda", 0), runtime)


def test_failed_pinning_resets_the_cuda_error_and_uploads_through_bounded_staging(
        conformance, caplog, monkeypatch):
    """cudaHostRegister fails: its error must not stay as the runtime's last error (PyTorch
    would raise it after its next, unrelated kernel launch), and uploads then go through a
    bounded pinned staging buffer, piece by piece, each buffer refilled only after the copy
    that last read it is done."""
    from seedvr2.memory import arena as arena_module
    from seedvr2.memory.placement import WeightStore

    runtime = FakeRuntime(register=2)  # cudaErrorMemoryAllocation
    model = load_dit(conformance / "dit3b_tiny" / "weights.safetensors")
    expected = {n: t.clone() for n, t in named_tensors(model)}
    chunk = 4096
    events: list[tuple] = []
    allocated: list[int] = []

    class Event:
        def __init__(self):
            self.slot = len(allocated) - 1

        def synchronize(self):
            events.append(("wait", self.slot))

        def record(self):
            events.append(("record", self.slot))

    def allocate(n):
        allocated.append(n)
        return torch.empty(n, dtype=torch.uint8)

    staging = arena_module.PinnedStaging(chunk_bytes=chunk, slots=2, allocate=allocate,
                                         new_event=Event)
    monkeypatch.setattr(arena_module, "PinnedStaging", lambda: staging)
    with caplog.at_level("WARNING", logger="seedvr2"):
        store = WeightStore(model, CPU, _failing_pin(runtime))
    assert runtime.calls == ["register", "get_last_error"] and runtime.last_error == 0
    assert "could not pin" in caplog.text and "(CUDA error 2)" in caplog.text
    assert "may be this one reported again" not in caplog.text
    assert not store.arena.pinned and store.arena.staging is staging

    copies = store.copy_to(range(len(store)), CPU)
    store.place(copies)
    assert all(torch.equal(t, expected[n]) for n, t in named_tensors(model))
    assert all(c.data_ptr() != store.arena.views[i].data_ptr() for i, c in copies.items()
               if c.numel())
    # Bounded: two buffers of one chunk, however big the model.
    nbytes = sum(v.numel() * v.element_size() for v in store.arena.views)
    assert allocated == [chunk, chunk] and store.pinned_bytes == 2 * chunk < nbytes
    pieces = sum(-(-v.numel() * v.element_size() // chunk) for v in store.arena.views)
    # Each piece: wait for the buffer's previous copy, then record its own copy.
    assert events == [(kind, k % 2) for k in range(pieces) for kind in ("wait", "record")]


def test_pinning_failure_without_error_reset_says_a_later_error_may_be_it(caplog):
    from seedvr2.memory.arena import HostArena

    arena = HostArena([((1024,), torch.float32)])
    with caplog.at_level("WARNING", logger="seedvr2"):
        arena.pin(_failing_pin(FakeRuntime(register=2, can_read_error=False)))
    assert "could not be reset: a later CUDA error may be this one reported again" in caplog.text


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only torch has no CUDA runtime")
def test_the_error_reset_comes_from_the_runtime_torch_loaded():
    """torch.cuda.cudart() has no cudaGetLastError: it is found in the libcudart torch loaded
    (a second copy of the runtime would keep a last error of its own)."""
    from seedvr2.memory.arena import _loaded_runtime_call

    assert _loaded_runtime_call("cudaGetLastError") is not None
    assert _loaded_runtime_call("noSuchCudaCall") is None


def test_unpinning_waits_for_the_compute_device_only_and_reports_failure(monkeypatch, caplog):
    """Unpinning waited for every visible GPU (creating a CUDA context on each, in every
    rank); the copies only ever go to the compute device. A failed unregister is reported
    and its error reset."""
    from seedvr2.memory import arena as arena_module
    from seedvr2.memory.placement import default_pin

    synchronized = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    runtime = FakeRuntime(unregister=1)  # cudaErrorInvalidValue
    monkeypatch.setattr(arena_module, "CudaRuntime", lambda: runtime)
    arena = HostArena([((2**20,), torch.float32)])
    arena.pin(default_pin(torch.device("cuda", 2), CPU))
    assert arena.pinned and runtime.calls == ["register"]
    with caplog.at_level("WARNING", logger="seedvr2"):
        arena.release()
    assert synchronized == [torch.device("cuda", 2)]
    assert runtime.calls == ["register", "unregister", "get_last_error"]
    assert runtime.last_error == 0
    assert "could not unpin 4.0 MiB of host memory (CUDA error 1): it stays page-locked " \
        "until the process ends" in caplog.text


# --------------------------------------------------------------------------------------------
# Offload between phases


def test_offload_parks_and_activates_without_copying_host_memory(conformance):
    """activate(): every tensor on the compute device; park(): every tensor is its view in the
    one persistent host copy again: the same memory every time, nothing copied back."""
    model = load_dit(conformance / "dit3b_tiny" / "weights.safetensors")
    expected = {n: t.clone() for n, t in named_tensors(model)}
    placed = OffloadedModel(model, META, CPU, None)
    arena = placed.store.arena
    start, stop = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.nbytes
    host = {n: (t.data_ptr(), t) for n, t in named_tensors(model)}
    assert all(start <= p < stop or t.numel() == 0 for p, t in host.values())
    for _ in range(3):
        placed.activate()
        assert _off_device(model) == []
        placed.park()
        assert {n: t.data_ptr() for n, t in named_tensors(model)} == {n: p for n, (p, _) in host.items()}
    assert all(torch.equal(t, expected[n]) for n, t in named_tensors(model))
    # Shared tensors stay shared on the device, under every name.
    placed.activate()
    assert len({id(b.attn.rope.rope.freqs) for b in model.blocks}) == 1


def test_budget_sizes_of_an_offloaded_model_are_unchanged(conformance):
    """The budget measures a loaded model tensor by tensor; an offloaded model's tensors are
    views of one arena and must not collapse into one."""
    from seedvr2.memory.budget import Weights, bytes_on
    from seedvr2.memory.placement import host_copy_bytes

    model = load_dit(conformance / "dit3b_tiny" / "weights.safetensors")
    before = Weights.of_module(model)
    placed = OffloadedModel(model, META, CPU, None)
    assert Weights.of_module(model) == before
    assert bytes_on(model, CPU) == host_copy_bytes(model)  # the memory held: the arena
