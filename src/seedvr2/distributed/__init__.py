"""Several processes, one video: frame-batch parallelism over torch.distributed.

Every rank derives the same batch plan; each rank takes the plan's next chunk (a contiguous
run of batches) when it is ready for one (``taking.py``; with sequence parallelism they are
dealt to the rank groups in turn), each rank reads only the frames its chunks need, and finished
batches travel to rank 0 — the writer — in plan order, where they are blended exactly as in
one process. Bounded memory: a rank holds at most its current chunk and one finished batch in
flight; results are bit-identical to the single-process run on CPU/gloo.

Launch with ``torchrun --nproc-per-node N -m seedvr2 upscale ...`` (also across machines), under
Slurm, or let ``--devices cuda:0,cuda:1`` (``cpu,cpu``) spawn the workers.

One batch too big for one device: ``sequence.py`` spreads a single DiT call over a group of
ranks (Ulysses sequence parallelism).
"""

from .assign import assign_batches
from .groups import DistContext, init_from_env, in_distributed_launch
from .sequence import (UlyssesSequenceParallel, sequence_group, sequence_parallel,
                       sequence_parallel_forward)

__all__ = ["DistContext", "UlyssesSequenceParallel", "assign_batches", "in_distributed_launch",
           "init_from_env", "sequence_group", "sequence_parallel", "sequence_parallel_forward"]
