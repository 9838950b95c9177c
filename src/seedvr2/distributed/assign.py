"""Which rank upscales which batches."""

from __future__ import annotations

from ..pipeline.plan import BatchPlan


def assign_batches(plan: BatchPlan, world_size: int, first_chunk: int = 0) -> list[list[int]]:
    """Batch indices per rank: the plan's chunks (contiguous runs) from ``first_chunk`` on
    (the ones before are complete in a resumed job) dealt out in turn, so the writer takes
    batches in order as they finish and ranks get equal work to within a chunk."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i, chunk in enumerate(plan.chunks[first_chunk:]):
        shares[i % world_size].extend(chunk)
    return shares
