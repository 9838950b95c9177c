"""Sequence parallelism: one DiT call spread over the ranks of a group (Ulysses all-to-all)
for a batch whose tokens do not fit one device: token shards outside attention, head shards
inside, so the result equals the one-process forward. The DiT knows nothing of processes
(:class:`UlyssesSequenceParallel` implements ``seedvr2.models.attention.SequenceParallel``).
Inference only; docs/multi-gpu.md#sequence-parallelism."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ..options import OptionError
from ..models.packing import Packing, to_device
from .peers import DistributedError, wait_until


def shard_bounds(total: int, parts: int) -> list[int]:
    """Row offsets of ``parts`` contiguous shards of ``total`` rows (the first ones one longer
    when ``parts`` does not divide it): shard r is ``[bounds[r], bounds[r + 1])``."""
    base, extra = divmod(total, parts)
    return [r * base + min(r, extra) for r in range(parts + 1)]


@dataclasses.dataclass
class ShardedPacking(Packing):
    """A packing whose ``per_token`` yields the video rows ``[rows[0], rows[1])`` only; window
    layouts, text positions and lengths still describe the whole call (attention needs them)."""

    rows: tuple[int, int] = (0, 0)

    def per_token(self, values: torch.Tensor, stream: str) -> torch.Tensor:
        if stream != "vid" or self.batch == 1:
            return super().per_token(values, stream)
        start, end = self.rows
        counts, offset = [], 0
        for n in self.vid_counts:
            counts.append(max(0, min(end, offset + n) - max(start, offset)))
            offset += n
        if "vid_shard" not in self.device_index:  # sent once per call (no host stall)
            self.device_index["vid_shard"] = to_device(torch.tensor(counts), values.device)
        return values.repeat_interleave(self.device_index["vid_shard"], dim=0,
                                        output_size=end - start)


class UlyssesSequenceParallel:
    """Token shards outside attention, head shards inside, over ``group`` (None: the default
    group), whose ranks make the same DiT calls with the same inputs."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None,
                 meeting: Optional["Meeting"] = None):
        if not dist.is_initialized():
            raise DistributedError("sequence parallelism needs an initialised torch.distributed "
                                   "process group (see seedvr2.distributed.init_from_env)")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.meeting = meeting  # where it meets before a shape's first exchanges (None: never)
        self.shapes_seen: set = set()
        self.meet_before_exchanges = False

    def _exchange(self, out, send, **kwargs):
        if self.meet_before_exchanges:
            self.meeting.meet()
        dist.all_to_all_single(out, send, group=self.group, **kwargs)

    def check(self, dit: torch.nn.Module):
        """Raise ``OptionError`` unless every attention layer's heads divide over the group."""
        for block in dit.blocks:
            self.head_range(block.attn.heads)

    # -- the SequenceParallel protocol ---------------------------------------------------------

    def _bounds(self, packing: Packing) -> list[int]:
        return shard_bounds(sum(packing.vid_counts), self.size)

    def shard(self, vid: torch.Tensor, packing: Packing) -> tuple[torch.Tensor, Packing]:
        # Every rank of the group makes the same calls, so all meet at the same exchanges.
        shape = (tuple(vid.shape), tuple(map(tuple, packing.patched_thw)),
                 tuple(packing.txt_lens))
        self.meet_before_exchanges = self.meeting is not None and shape not in self.shapes_seen
        self.shapes_seen.add(shape)
        bounds = self._bounds(packing)
        start, end = bounds[self.rank], bounds[self.rank + 1]
        fields = {f.name: getattr(packing, f.name) for f in dataclasses.fields(Packing)}
        return vid[start:end], ShardedPacking(**fields, rows=(start, end))

    def gather(self, vid: torch.Tensor, packing: Packing) -> torch.Tensor:
        counts = _counts(self._bounds(packing))
        out = vid.new_empty((sum(counts), *vid.shape[1:]))
        send = vid.unsqueeze(0).expand(self.size, *vid.shape).contiguous().view(
            self.size * vid.shape[0], *vid.shape[1:])
        self._exchange(out, send, output_split_sizes=counts,
                       input_split_sizes=[vid.shape[0]] * self.size)
        return out

    def head_range(self, heads: int) -> slice:
        if problem := heads_problem(heads, self.size):
            raise OptionError(problem)
        own = heads // self.size
        return slice(self.rank * own, (self.rank + 1) * own)

    def scatter_heads(self, qkv: torch.Tensor, packing: Packing) -> torch.Tensor:
        n, three, heads, head_dim = qkv.shape
        own = self.head_range(heads).stop - self.head_range(heads).start
        # Destination-major: chunk r holds this rank's tokens, rank r's heads.
        send = qkv.view(n, three, self.size, own, head_dim).permute(2, 0, 1, 3, 4).contiguous()
        counts = _counts(self._bounds(packing))
        out = qkv.new_empty((sum(counts), three, own, head_dim))
        self._exchange(out, send.view(-1, three, own, head_dim), output_split_sizes=counts,
                       input_split_sizes=[n] * self.size)
        return out  # sources in rank order = tokens in packed order

    def gather_heads(self, vid: torch.Tensor, txt: Optional[torch.Tensor]):
        bounds = shard_bounds(vid.shape[0], self.size)
        n = bounds[self.rank + 1] - bounds[self.rank]
        nt = 0 if txt is None else txt.shape[0]
        # Chunk r: rank r's video rows, then every text row (own heads); one exchange for both.
        if txt is None:
            send = vid.contiguous()
        else:
            send = torch.cat([piece for r in range(self.size)
                              for piece in (vid[bounds[r]:bounds[r + 1]], txt)])
        out = vid.new_empty((self.size * (n + nt), vid.shape[1]))
        self._exchange(out, send, output_split_sizes=[n + nt] * self.size,
                       input_split_sizes=[c + nt for c in _counts(bounds)])
        width = self.size * vid.shape[1]
        out = out.view(self.size, n + nt, vid.shape[1])  # source rank = head block
        vid_out = out[:, :n].transpose(0, 1).reshape(n, width)
        txt_out = None if txt is None else out[:, n:].transpose(0, 1).reshape(nt, width)
        return vid_out, txt_out


def heads_problem(heads: int, size: int) -> Optional[str]:
    """Why ``heads`` attention heads cannot be split over ``size`` ranks, or None."""
    return None if heads % size == 0 else (
        f"sequence parallelism over {size} ranks needs a head count divisible by {size}; this "
        f"DiT has {heads} heads (use a group size that divides {heads})")


def _counts(bounds: list[int]) -> list[int]:
    return [b - a for a, b in zip(bounds, bounds[1:])]


def sequence_group(size: int, timeout: Optional[datetime.timedelta] = None
                   ) -> Optional[dist.ProcessGroup]:
    """This rank's group when the world is cut into groups of ``size`` consecutive ranks
    (None: the whole world). Collective: every rank calls it, with the same ``size``."""
    world = dist.get_world_size()
    if size < 1 or world % size:
        raise OptionError(f"sequence_parallel={size} must divide the number of ranks ({world})")
    return None if size == world else _own_group(size, timeout=timeout)


def _own_group(size: int, **group_args) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks; every rank makes every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + size)), **group_args)
              for start in range(0, world, size)]
    return groups[rank // size]


def meeting_group(size: int, timeout: Optional[datetime.timedelta] = None
                  ) -> Optional[dist.ProcessGroup]:
    """A gloo group of this rank's sequence group, for what a :class:`Meeting` sends (None for
    a group of one). Collective, as :func:`sequence_group`."""
    return None if size == 1 else _own_group(size, timeout=timeout, backend="gloo")


class Meeting:
    """The ranks of one sequence group meet in the job's store before a collective that may
    wait for the slowest (a shape's first DiT exchanges, each latent's broadcast): loading,
    encoding and compiling can set them minutes apart. The wait is polled there, watching each
    peer (a lost one raises :class:`~.peers.RankLost`), so the collective waits for its
    transfer only. ``group``: the gloo :func:`meeting_group`; ``ranks``: the group's ranks."""

    def __init__(self, group: Optional[dist.ProcessGroup], ranks: list[int], rank: int, keys,
                 liveness):
        self.group, self.ranks, self.rank = group, ranks, rank
        self.keys, self.liveness = keys, liveness
        self.held = 0  # meetings so far: every rank of the group holds the same ones

    def meet(self):
        self.held += 1
        store, key = self.keys.store, self.keys.key(f"meeting/{self.ranks[0]}/{self.held}")
        store.add(key, 1)
        wait_until(lambda: store.add(key, 0) >= len(self.ranks), self._watch)

    def _watch(self):
        for rank in self.ranks:
            if rank != self.rank:
                self.liveness.check(rank)


@contextlib.contextmanager
def sequence_parallel(dit: torch.nn.Module, group: Optional[dist.ProcessGroup] = None,
                      meeting: Optional[Meeting] = None
                      ) -> Iterator[Optional[UlyssesSequenceParallel]]:
    """Within the block, ``dit``'s calls run sequence-parallel over ``group`` (a group of one
    leaves it as it is); the previous strategy comes back afterwards."""
    strategy = UlyssesSequenceParallel(group, meeting)
    if strategy.size == 1:
        yield None
        return
    strategy.check(dit)
    previous = dit.sequence_parallel
    dit.set_sequence_parallel(strategy)
    try:
        yield strategy
    finally:
        dit.set_sequence_parallel(previous)
