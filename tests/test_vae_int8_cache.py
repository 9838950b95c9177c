"""vae_int8_cache (issue 42 §2.4, §2.5): int8 causal tails cost less than the tails they
replace while they are made and read (a piece at a time, no float32 copy of a whole tail), a
parked tail's fetch overlaps the conv before it (a side stream, waited for before use), and
the budget counts the cache in every mode.

The stream order is checked on the shared fake ``cuda:0`` (tests/fake_cuda.py), whose log
holds every copy, stream and event call in issue order."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from seedvr2.memory import budget as mem
from seedvr2.models import vae_paths
from seedvr2.models.config import vae_config
from seedvr2.models.vae_blocks import CausalCache, CausalConv3d
from seedvr2.models.vae_paths import INT8_CACHE_BYTES, PackedTail, VaePaths

from conftest import REPO
from fake_cuda import Op, fake_cuda

sys.path.insert(0, str(REPO / "bench"))

from memory_trace import LiveBytes  # noqa: E402

F16 = torch.float16
SHAPE = (1, 16, 2, 64, 64)  # a tail: 131072 values
ROWS = 8  # rows of a frame per piece below


def _tail() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(F16)


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(vae_paths, "PIECE_ELEMENTS", SHAPE[0] * SHAPE[1] * ROWS * SHAPE[4],
                        raising=False)
    return SHAPE[0] * SHAPE[1] * ROWS * SHAPE[4] * 4  # a piece's float32 bytes


def test_packing_holds_one_piece_in_float32_not_the_tail(small_pieces):
    """Beside the tail (and the padded buffer it is cut from) packing makes the int8 codes
    and one piece of float32 values at a time: before, two float32 copies of the whole tail
    (8 bytes per value) were alive at once."""
    tail = _tail()
    counter = LiveBytes("cpu")
    counter.track(tail)  # seen through views: counted first
    with counter:
        packed = PackedTail.pack(tail)
    assert packed.codes.dtype == torch.int8 and packed.codes.numel() == tail.numel()
    made = counter.peak - tail.numel() * tail.element_size()
    assert made <= tail.numel() + small_pieces + 64, made


def test_a_packed_tail_is_unpacked_straight_into_the_buffer_head(small_pieces, monkeypatch):
    """The head of the conv's padded input is written from the codes a piece at a time: no
    float32 tail and no tail in the model dtype is made on the way (before: both)."""
    conv = CausalConv3d(16, 16, 3, padding=1).half()
    cache = CausalCache(paths=VaePaths(int8_cache_bytes=1))
    tail = _tail()
    cache.set_tail(conv, tail)
    buf, body = conv.input_buffer(tail, (1, 16, 3, 64, 64), cache)
    body.copy_(torch.randn(body.shape, generator=torch.Generator().manual_seed(1)).to(F16))
    monkeypatch.setattr(conv, "_conv", lambda padded, cache, residual=None: None)  # head only
    counter = LiveBytes("cpu")
    kept = cache.tail(conv)
    for held in (buf, kept.codes if isinstance(kept, PackedTail) else kept):  # seen through
        counter.track(held)  # views: counted first
    before = counter.now
    with counter:
        conv.forward_padded(buf, cache)
    assert counter.peak - before <= small_pieces + 64, counter.peak - before
    step = tail.float().abs().max() / 127
    error = (buf[:, :, :2].float() - tail.float()).abs()
    assert (error <= step / 2 * (1 + 1e-6) + torch.finfo(F16).eps * tail.float().abs()).all()


# -- the prefetch's stream order --------------------------------------------------------------

class LoggedArena:
    """A parked tail's host memory (``placement.tail_parking``'s arena): real host bytes, so
    the fake GPU logs each copy out of it on the stream current at the time."""

    def __init__(self, n: int):
        self.views = [torch.empty(n, dtype=torch.int8)]

    def copy_into(self, index: int, out: torch.Tensor):
        out.copy_(self.views[index], non_blocking=True)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("weight", torch.empty(1, device="cuda:0"))


STREAM_ORDER = ("conv", "copy", "record", "wait_event", "wait_stream", "record_stream")


def test_a_parked_tail_is_fetched_on_a_side_stream_while_the_conv_before_it_runs():
    """The next parked tail's copy is issued on a side stream (after the compute stream's
    work so far: its packing), before the current conv; the compute stream waits for its
    event before reading it, and the codes are recorded on the compute stream (made on the
    side stream, freed after this use). Before, the copy was issued on the compute stream:
    it ran after the conv it was meant to overlap."""
    with fake_cuda() as gpu:
        layers = [Layer() for _ in range(3)]
        cache = CausalCache(paths=VaePaths(int8_cache_bytes=1, cache_offload=True),
                            park=LoggedArena)
        tails = [torch.empty(1, 4, 2, 8, 8, dtype=F16, device="cuda:0") for _ in layers]
        for layer, tail in zip(layers, tails):  # chunk 1: each conv keeps its tail
            cache.set_tail(layer, tail)
        start = len(gpu.log)
        for layer, tail in zip(layers, tails):  # chunk 2: each conv reads, then keeps
            assert cache.tail(layer).codes.device == torch.device("cuda:0")
            gpu.log.append(Op("conv", gpu.current.name, ""))
            cache.set_tail(layer, tail)
    log = [(op.kind, op.stream, op.detail.split(" ")[0])
           for op in gpu.log[start:] if op.kind in STREAM_ORDER]
    side = next(stream for kind, stream, _ in log if stream != "default")
    events = iter(detail for kind, _, detail in log if kind == "record")

    def ahead(event):  # the next tail's copy, issued on the side stream
        return [("wait_stream", side, "default"), ("copy", side, "cpu->cuda:0"),
                ("record", side, event)]

    def read(event):  # the compute stream's use of a tail fetched ahead
        return [("wait_event", "default", event), ("record_stream", "default", "512")]
    # each conv, then its new tail parked on the host (codes and scales)
    conv = [("conv", "default", ""), *[("copy", "default", "cuda->cpu")] * 2]
    first = [("copy", "default", "cpu->cuda:0")]  # nothing was ahead of it
    one, two = next(events), next(events)
    assert log == [*first, *ahead(one), *conv, *read(one), *ahead(two), *conv, *read(two), *conv]


# -- the budget ---------------------------------------------------------------------------

def test_the_budget_counts_the_int8_cache_in_every_mode():
    """3B 1080p x 21 decoded in temporal slices: the full-resolution tails at one byte per
    value with ``on``, only the two in flight with ``host`` (before, every mode was counted as
    ``off``, so no fit could propose the cache)."""
    cfg = vae_config("vae")
    assert 2 * cfg.block_out_channels[0] * 1088 * 1920 >= INT8_CACHE_BYTES  # they qualify
    decode = {mode: mem._vae_phase(cfg, mem.BatchShape(1080, 1920, 21, decode_slice=4,
                                                       vae_int8_cache=mode), decode=True)
              for mode in ("off", "on", "host")}
    assert decode["off"] > decode["on"] > decode["host"]
