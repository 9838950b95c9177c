"""Process groups: who am I, how many are we (torchrun's variables, Slurm's, or our spawn
launcher's), and the backend to talk with (NCCL when every rank has its own CUDA device, gloo
otherwise). Every collective inherits its group's timeout (:func:`group_timeout`)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .peers import DistributedError


# NCCL's watchdog counts a collective's timeout from its enqueue, up to a whole DiT forward ahead of
# the GPU: an NCCL group waits far longer than any forward (a lost peer is found by peers.py).
NCCL_TIMEOUT = datetime.timedelta(hours=1)


def group_timeout(backend: str, timeout_s: float) -> datetime.timedelta:
    """A process group's timeout: ``dist_timeout`` for gloo, whose waits start with the call;
    at least :data:`NCCL_TIMEOUT` for NCCL."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return max(timeout, NCCL_TIMEOUT) if backend == "nccl" else timeout


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def gather(self, value) -> list:
        """Every rank's ``value``, in rank order (collective)."""
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def in_distributed_launch() -> bool:
    """True inside a multi-process launch (torchrun or Slurm with several tasks)."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))) > 1


def _env_ranks() -> tuple[int, int, int]:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                int(os.environ.get("LOCAL_RANK", "0")))
    if "SLURM_PROCID" in os.environ:
        if "MASTER_ADDR" not in os.environ:
            raise DistributedError("under Slurm, set MASTER_ADDR (and MASTER_PORT) to the first "
                                   "node's address for the rendezvous")
        os.environ.setdefault("MASTER_PORT", "29500")
        return (int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]),
                int(os.environ.get("SLURM_LOCALID", "0")))
    return 0, 1, 0


def init_from_env(device_spec: str = "auto", timeout_s: float = 60.0,
                  rank: int | None = None, world_size: int | None = None,
                  local_rank: int | None = None, store: dist.Store | None = None) -> DistContext:
    """Join (or create) the default process group, meeting in ``store`` when given (our
    launcher's) else as torchrun or Slurm say, and pick this rank's device."""
    env_rank, env_world, env_local = _env_ranks()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    local_rank = env_local if local_rank is None else local_rank
    if device_spec == "auto":
        device = torch.device("cuda", local_rank % torch.cuda.device_count()) \
            if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = torch.device(device_spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = store if store is not None else _restart_store(
            datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=group_timeout(backend, timeout_s), store=store,
                                device_id=device if backend == "nccl" else None)
    return DistContext(rank, world_size, local_rank, device)


def _restart_store(timeout: datetime.timedelta):
    """Under torchrun, a store of this restart attempt's own (its keys prefixed with the
    attempt number: docs/multi-gpu.md#under-torchrun); None elsewhere (``env://``)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"seedvr2/attempt{attempt}/", agent)


def destroy():
    if dist.is_initialized():
        dist.destroy_process_group()
