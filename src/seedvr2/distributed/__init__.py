"""Several processes, one video: frame-batch parallelism over torch.distributed (torchrun,
Slurm, or ``--devices`` spawning the workers), with results bit-identical to one process on
CPU/gloo; ``sequence.py`` spreads one DiT call over a group of ranks. See docs/multi-gpu.md."""

from .groups import DistContext, init_from_env, in_distributed_launch
from .sequence import UlyssesSequenceParallel, sequence_group, sequence_parallel
from .taking import assign_batches

__all__ = ["DistContext", "UlyssesSequenceParallel", "assign_batches", "in_distributed_launch",
           "init_from_env", "sequence_group", "sequence_parallel"]
