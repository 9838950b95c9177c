"""Frames from worker ranks to the writer: the message format and the group they travel on,
checked without processes or CUDA (the rank-vs-one-process tests in test_distributed.py run
the same code end to end over gloo)."""

from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from seedvr2.distributed import frames as wire
from seedvr2.options import resolve_options
from seedvr2.pipeline.plan import make_plan
from seedvr2.pipeline.runner import OverlapBlender, integer_frames, to_integer_frames


def _plan():
    # 23 frames, batches of 5 overlapping by 1: [0,5) [4,9) ... [20,23)
    return make_plan(23, resolve_options(batch_size=5, temporal_overlap=1, prepend_frames=0,
                                         scene_cuts="off"))


def test_quantized_span_leaves_every_blended_frame_float():
    plan = _plan()
    first, middle, last = plan.batches[0], plan.batches[1], plan.batches[-1]
    assert wire.quantized_span(plan, first) == (0, 4)  # frame 4 is blended with batch 1
    assert wire.quantized_span(plan, middle) == (1, 4)  # frame 0 with batch 0, 4 with batch 2
    assert wire.quantized_span(plan, last) == (1, last.frames)  # nothing follows the last
    # An overlap of half the batch or more: every frame is blended, none is rounded early.
    wide = make_plan(23, resolve_options(batch_size=5, temporal_overlap=3, prepend_frames=0,
                                         scene_cuts="off"))
    assert wire.quantized_span(wide, wide.batches[1]) == (0, 0)


@pytest.mark.parametrize("bit_depth, wire_dtype", [(8, torch.uint8), (16, torch.int16)])
def test_batch_message_round_trip(bit_depth, wire_dtype):
    frames = torch.rand(5, 6, 7, 3, generator=torch.Generator().manual_seed(bit_depth))
    message = wire.encode_batch(frames, (1, 4), bit_depth)
    header = dict(zip(wire.HEADER_FIELDS, message.header.tolist()))
    assert header == dict(magic=wire.MAGIC, frames=5, height=6, width=7, channels=3,
                          bit_depth=bit_depth, quantized_start=1, quantized_stop=4)
    assert message.quantized.dtype == wire_dtype and message.quantized.shape == (3, 6, 7, 3)
    assert message.exact.dtype == torch.float32 and message.exact.shape == (2, 6, 7, 3)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in message.tensors())
    # The integers on the wire are the writer's own (16 bit: the uint16 bit pattern).
    as_sent = message.quantized.view(torch.uint16) if bit_depth == 16 else message.quantized
    assert torch.equal(as_sent, integer_frames(frames[1:4], bit_depth))

    # The receiver's buffers, filled as recv would, decode to frames whose blended frames are
    # the sender's float32 bits and whose other frames write the same integers.
    received = wire.buffers_for(message.header.clone(), (5, 6, 7, 3), "rank 1")
    received.quantized.copy_(message.quantized)
    received.exact.copy_(message.exact)
    decoded = wire.decode_batch(received)
    assert decoded.shape == frames.shape and decoded.dtype == torch.float32
    assert torch.equal(decoded[[0, 4]], frames[[0, 4]])
    assert np.array_equal(to_integer_frames(decoded, bit_depth), to_integer_frames(frames, bit_depth))


def test_float_output_travels_unrounded():
    frames = torch.rand(5, 4, 4, 1)
    message = wire.encode_batch(frames, (1, 4), None)
    assert message.quantized.numel() == 0 and message.header[5] == 32
    received = wire.buffers_for(message.header, (5, 4, 4, 1), "rank 2")
    received.exact.copy_(message.exact)
    assert torch.equal(wire.decode_batch(received), frames)


@pytest.mark.parametrize("bit_depth", [8, 16])
def test_every_integer_survives_decoding_and_the_writers_rounding(bit_depth):
    """decode_batch's claim, exhaustively: round((q / scale) * scale) == q for every level."""
    levels = torch.arange(2 ** bit_depth, dtype=torch.int64)
    wire_values = levels.to(torch.uint8) if bit_depth == 8 else levels.to(torch.uint16).view(torch.int16)
    message = wire.BatchMessage(
        torch.tensor([wire.MAGIC, len(levels), 1, 1, 1, bit_depth, 0, len(levels)]),
        wire_values.reshape(-1, 1, 1, 1), torch.empty(0, 1, 1, 1))
    decoded = wire.decode_batch(message)
    assert np.array_equal(to_integer_frames(decoded, bit_depth).ravel().astype(np.int64),
                          levels.numpy())


def test_bad_headers_are_named():
    good = wire.encode_batch(torch.rand(5, 2, 2, 3), (1, 4), 8).header
    stray = good.clone()
    stray[0] = 7
    with pytest.raises(RuntimeError, match="rank 3 sent a message that is not a frame batch"):
        wire.buffers_for(stray, (5, 2, 2, 3), "rank 3")
    with pytest.raises(RuntimeError, match=r"rank 1 sent frames of shape \(5, 2, 2, 3\), the plan "
                                           r"expects \(5, 4, 4, 3\); every rank must run the same"):
        wire.buffers_for(good, (5, 4, 4, 3), "rank 1")
    with pytest.raises(ValueError, match="frames travel at 8 or 16 bits"):
        wire.encode_batch(torch.rand(1, 1, 1, 1), (0, 1), 10)


def test_frame_group_is_gloo_whatever_the_default_backend():
    """The group is created with gloo explicitly (not inherited from an NCCL default group),
    with the job's own timeout: no longer two hours (issue 38), as its waits last a
    transfer (the hand-over)."""
    calls = []
    group = wire.frame_group(datetime.timedelta(seconds=60),
                             new_group=lambda **kw: calls.append(kw) or "frames-group")
    assert group == "frames-group"
    assert calls == [dict(backend="gloo", timeout=datetime.timedelta(seconds=60))]


def _messages(sent, index: int) -> int:
    return sum(tag // 3 == index for _, _, tag, _ in sent)


def test_worker_sends_cpu_integers_on_the_frame_group(monkeypatch):
    """The worker's send loop, with torch.distributed replaced by a recorder: every tensor
    it posts is a CPU tensor on the frame group, middle frames as uint8, and the receiving
    side's decode + blend writes what one process writes."""
    from seedvr2.distributed import rank_work as job

    plan = _plan()
    outputs = [(b, torch.rand(b.frames, 4, 6, 3, generator=torch.Generator().manual_seed(b.index)))
               for b in plan.batches]
    sent, events = [], []

    class Work:
        def __init__(self, tag):
            self.tag = tag

        def wait(self):
            events.append(("wait", self.tag // 3))

    class Handover:  # the store marks, recorded
        def posted(self, index):
            events.append(("posted", index))

        def wait_receiving(self, index):
            events.append(("writer receives", index))
    def isend(tensor, dst, tag, group):
        sent.append((tensor.clone(), dst, tag, group))
        return Work(tag)
    monkeypatch.setattr(wire.dist, "isend", isend)
    ctx = job.DistContext(1, 2, 1, torch.device("cpu"))
    rank_job = job.Job(resolve_options(), (), Path())  # no faults
    links = SimpleNamespace(frames_group="frames-group", handover=Handover())
    job._send_all(job.RankWork(ctx, rank_job, plan, None, (4, 6, 3), 8), links, iter(outputs))
    assert {(dst, group) for _, dst, _, group in sent} == {(0, "frames-group")}
    # One message in flight, and gloo waited on only once the writer receives it: a wait
    # inside gloo lasts one transfer, never a batch's computation.
    expected = []
    for i in range(len(outputs)):
        if i:
            expected += [("writer receives", i - 1)] + [("wait", i - 1)] * _messages(sent, i - 1)
        expected.append(("posted", i))
    last = len(outputs) - 1
    expected += [("writer receives", last)] + [("wait", last)] * _messages(sent, last)
    assert events == expected
    assert all(t.device.type == "cpu" for t, *_ in sent)
    assert {t.dtype for t, *_ in sent} == {torch.int64, torch.uint8, torch.float32}

    # Rebuild each batch from what was sent, blend, and compare with blending the originals.
    by_tag = {tag: t for t, _, tag, _ in sent}
    one, many = OverlapBlender(plan), OverlapBlender(plan)
    for b, out in outputs:
        h, q, e = (by_tag.get(tag) for tag in wire.tags(b.index))
        message = wire.buffers_for(h, out.shape, "rank 1")
        if q is not None:
            message.quantized.copy_(q)
        if e is not None:
            message.exact.copy_(e)
        received = wire.decode_batch(message)
        for (_, a), (_, c) in zip(one.add(b, out), many.add(b, received)):
            assert np.array_equal(to_integer_frames(a, 8), to_integer_frames(c, 8))


def test_blender_works_on_the_frames_device():
    """Decoded frames may stay on the GPU (file jobs round them there): the cross-fade weights
    must follow them. ``meta`` stands in for the GPU."""
    plan = _plan()
    blender = OverlapBlender(plan)
    emitted = []
    for b in plan.batches:
        for first, final in blender.add(b, torch.empty(b.frames, 4, 6, 3, device="meta")):
            assert final.device.type == "meta"
            emitted.append((first, final.shape[0]))
    assert sum(n for _, n in emitted) == 23
