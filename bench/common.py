"""Shared timing helpers for the benchmarks (best-of-N wall time, matmul reference rate)."""

from __future__ import annotations

import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def synchronizer(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def best_time(fn, repeats: int, sync) -> float:
    """Fastest of ``repeats`` runs after one warm-up run, in seconds."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops_per_s(device: torch.device, dtype: torch.dtype, size: int = 2048) -> float:
    """The machine's dense matmul rate on size x size matrices: the denominator of every ratio."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size ** 3 / best_time(lambda: torch.matmul(a, b), 10, synchronizer(device))
