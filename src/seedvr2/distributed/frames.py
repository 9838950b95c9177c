"""Finished batches from a worker rank to the writer rank: their process group (gloo, CPU
tensors, whatever the default group's backend), the hand-over that keeps its waits short, and
the wire format (the writer's integers where no cross-fade mixes frames, float32 where one
does). Why: docs/multi-gpu.md#how-frames-travel.

Message for one batch: an int64 header (``HEADER_FIELDS``), then the integer frames (possibly
none), then the float32 frames (possibly none), each under its own tag."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import InputError
from ..pipeline.plan import Batch, BatchPlan
from ..pipeline.runner import integer_frames
from .peers import DistributedError, JobKeys, Liveness, wait_until

HEADER_FIELDS = ("magic", "frames", "height", "width", "channels", "bit_depth",
                 "quantized_start", "quantized_stop")
MAGIC = 0x5EED_F4A3  # a header that is not ours (a stray message) is refused, not misread
# uint16 travels as its bit pattern in int16: every backend moves int16, not every one uint16.
_WIRE_DTYPE = {8: torch.uint8, 16: torch.int16}
_SCALE = {8: 255.0, 16: 65535.0}


def frame_group(timeout: datetime.timedelta, new_group: Callable = None):
    """The gloo group frames travel over, whatever the default backend, with the job's timeout (its
    waits last one transfer: :class:`Handover`); every rank calls this, in group-creation order."""
    new_group = new_group or dist.new_group
    return new_group(backend="gloo", timeout=timeout)


class Handover:
    """A batch changes hands when both ends are there: the sender marks ``sent/I`` in the store
    once its message is posted, the writer ``receiving/I`` once it receives; each polls for the
    other's mark there, watching that the other lives (:func:`~.peers.wait_until`), never inside
    gloo, so a gloo wait lasts one transfer (docs/multi-gpu.md#how-frames-travel)."""

    def __init__(self, keys: JobKeys, liveness: Liveness):
        self.keys, self.liveness = keys, liveness

    def posted(self, index: int):
        self.keys.mark(f"sent/{index}")

    def wait_posted(self, index: int, sender: int,
                    meanwhile: Callable[[], bool] = lambda: False):
        """Until ``sender`` has posted batch ``index`` (:class:`RankLost` if lost first)."""
        wait_until(lambda: self.keys.exists(f"sent/{index}"),
                   lambda: self.liveness.check(sender), meanwhile)

    def receiving(self, index: int):
        self.keys.mark(f"receiving/{index}")

    def wait_receiving(self, index: int, writer: int = 0):
        """Until the writer receives batch ``index`` (:class:`RankLost` if lost first)."""
        wait_until(lambda: self.keys.exists(f"receiving/{index}"),
                   lambda: self.liveness.check(writer))


def quantized_span(plan: BatchPlan, batch: Batch) -> tuple[int, int]:
    """Frames [start, stop) of ``batch`` (batch-relative) that no cross-fade touches."""
    start = batch.overlap
    stop = plan.emit_stop(batch) - batch.start
    return (start, stop) if start < stop else (0, 0)


@dataclass
class BatchMessage:
    header: torch.Tensor  # int64 (len(HEADER_FIELDS),)
    quantized: torch.Tensor  # (stop - start, H, W, C) in the wire dtype, CPU
    exact: torch.Tensor  # (frames - (stop - start), H, W, C) float32, CPU

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.header, self.quantized, self.exact


def encode_batch(frames: torch.Tensor, span: tuple[int, int], bit_depth: Optional[int]) -> BatchMessage:
    """``frames`` (n, H, W, C) float32 in [0, 1], any device, as CPU tensors: with
    ``bit_depth`` 8 or 16 those in ``span`` as the writer's integers (rounded where the frames
    are), the rest (all for ``None``) float32."""
    n, height, width, channels = frames.shape
    start, stop = span if bit_depth is not None else (0, 0)
    if bit_depth is not None and bit_depth not in _WIRE_DTYPE:
        raise InputError(f"frames travel at 8 or 16 bits (or float32 with bit_depth=None), "
                         f"not {bit_depth}")
    header = torch.tensor([MAGIC, n, height, width, channels, bit_depth or 32, start, stop],
                          dtype=torch.int64)
    if stop > start:
        quantized = integer_frames(frames[start:stop], bit_depth)
        quantized = quantized.view(_WIRE_DTYPE[bit_depth]).cpu().contiguous()
    else:
        quantized = torch.empty((0, height, width, channels), dtype=torch.uint8)
    exact = torch.cat([frames[:start], frames[stop:]]).float().cpu().contiguous()
    return BatchMessage(header, quantized, exact)


def buffers_for(header: torch.Tensor, expected: tuple[int, int, int, int],
                source: str) -> BatchMessage:
    """Receive buffers for the message ``header`` announces; ``expected`` = (frames, H, W, C)."""
    fields = dict(zip(HEADER_FIELDS, header.tolist()))
    if fields["magic"] != MAGIC:
        raise DistributedError(f"{source} sent a message that is not a frame batch (header "
                               f"{header.tolist()}); are two jobs sharing one rendezvous port?")
    shape = (fields["frames"], fields["height"], fields["width"], fields["channels"])
    if shape != tuple(expected):
        raise DistributedError(f"{source} sent frames of shape {shape}, the plan expects "
                               f"{tuple(expected)}; every rank must run the same command")
    depth, start, stop = fields["bit_depth"], fields["quantized_start"], fields["quantized_stop"]
    if depth not in (8, 16, 32) or not 0 <= start <= stop <= shape[0]:
        raise DistributedError(f"{source} sent an invalid frame header {fields}")
    rest = shape[1:]
    quantized = torch.empty((stop - start, *rest), dtype=_WIRE_DTYPE.get(depth, torch.uint8))
    exact = torch.empty((shape[0] - (stop - start), *rest), dtype=torch.float32)
    return BatchMessage(header, quantized, exact)


def decode_batch(message: BatchMessage) -> torch.Tensor:
    """The float32 frames (n, H, W, C) for the blender. Integers come back as ``q / scale``,
    which the writer's ``round(x * scale)`` turns back into exactly ``q``: two float32
    operations err by at most ``q · 2⁻²³`` (< 0.008 for q ≤ 65535), far from 0.5."""
    fields = dict(zip(HEADER_FIELDS, message.header.tolist()))
    start, stop, depth = fields["quantized_start"], fields["quantized_stop"], fields["bit_depth"]
    if stop == start:
        return message.exact
    quantized = message.quantized
    if depth == 16:
        quantized = quantized.view(torch.uint16)
    values = quantized.float() / _SCALE[depth]
    exact = message.exact
    return torch.cat([exact[:start], values, exact[start:]])


def tags(batch_index: int) -> tuple[int, int, int]:
    """The message tags of one batch: header, integer frames, float32 frames."""
    return batch_index * 3, batch_index * 3 + 1, batch_index * 3 + 2


def send_batch(message: BatchMessage, dst: int, batch_index: int, group) -> list:
    """Posts the message's sends; keep ``message`` alive until the returned works are waited on."""
    works = []
    for tensor, tag in zip(message.tensors(), tags(batch_index)):
        if tensor.numel():
            works.append(dist.isend(tensor, dst=dst, tag=tag, group=group))
    return works


def recv_batch(src: int, batch_index: int, expected: tuple[int, int, int, int], group) -> torch.Tensor:
    header_tag, quantized_tag, exact_tag = tags(batch_index)
    header = torch.zeros(len(HEADER_FIELDS), dtype=torch.int64)
    dist.recv(header, src=src, tag=header_tag, group=group)
    message = buffers_for(header, expected, f"rank {src}")
    if message.quantized.numel():
        dist.recv(message.quantized, src=src, tag=quantized_tag, group=group)
    if message.exact.numel():
        dist.recv(message.exact, src=src, tag=exact_tag, group=group)
    return decode_batch(message)
