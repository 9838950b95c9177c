"""The VAE side of sequence parallelism: the ranks of a group share each chunk's VAE work. A
batch's owner (:func:`vae_owners`) alone encodes it, sends the latent to the group before the
joint DiT call, and decodes and delivers it (docs/multi-gpu.md#sequence-parallelism)."""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..pipeline.plan import Batch, BatchPlan
from ..pipeline.runner import Upscaler, Encoded
from .sequence import Meeting

log = logging.getLogger("seedvr2")


def vae_owners(plan: BatchPlan, size: int) -> dict[int, int]:
    """Rank in its group (0 .. size-1) encoding and decoding each batch: a chunk's dealt in turn."""
    return {b: position % size for chunk in plan.chunks for position, b in enumerate(chunk)}


class SharedVaeUpscaler(Upscaler):
    """An :class:`Upscaler` for one rank of a sequence-parallel group: the VAE phases run only
    its own batches (the others come out with ``None`` frames), the DiT every batch. ``seat``:
    its place in the group and the global rank of the group's first."""

    def __init__(self, models, opts, progress, should_stop, *, owners: dict[int, int],
                 seat: tuple[int, int], meeting: Meeting):
        super().__init__(models, opts, progress, should_stop)
        self.owners = owners
        self.group_rank, self.first_rank = seat
        self.meeting = meeting

    def owns(self, batch: Batch) -> bool:
        return self.owners[batch.index] == self.group_rank

    def _encode(self, batch: Batch, frames: list, size: tuple[int, int]):
        if not self.owns(batch):
            return Encoded(batch, None, None, size)  # its latent arrives before the DiT call
        log.debug("VAE of batch %d: encoded and decoded on this rank", batch.index)
        return super()._encode(batch, frames, size)

    def _denoise(self, item):
        self._share_latent(item)
        super()._denoise(item)

    def _decode(self, item) -> Optional[torch.Tensor]:
        if self.owns(item.batch):
            return super()._decode(item)
        item.result = None
        return None

    def _share_latent(self, item):
        """The owner's latent of ``item`` to every rank of the group (in plan order on every
        rank), once all are there: the owner may have encoded it long before the others."""
        owner = self.first_rank + self.owners[item.batch.index]
        shape = [None]  # (size, dtype) of the latent, from its owner
        if self.owns(item.batch):
            # On the host for gloo: with tensor_offload_device cpu (the default) it is there
            # already; otherwise this copy waits for the encode, which is finished anyway.
            latent = item.latent.cpu().contiguous()
            shape = [(tuple(latent.shape), latent.dtype)]
        self.meeting.meet()
        dist.broadcast_object_list(shape, src=owner, group=self.meeting.group)
        if not self.owns(item.batch):
            latent = torch.empty(shape[0][0], dtype=shape[0][1])
        dist.broadcast(latent, src=owner, group=self.meeting.group)
        if not self.owns(item.batch):
            # Kept where the owner keeps it; to a GPU a few MB a batch: negligible beside the DiT.
            item.latent = latent.to(self.offload)
