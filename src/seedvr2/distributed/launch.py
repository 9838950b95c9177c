"""The single-command launcher: ``--devices cuda:0,cuda:1`` (or ``cpu,cpu``) spawns one worker
process per device on this machine, wired into one process group over the loopback."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from .groups import destroy, init_from_env


def parse_devices(spec: str) -> list[str]:
    """``auto`` = every visible GPU, else one CPU process."""
    if spec == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    devices = [d.strip() for d in spec.split(",")]
    for d in devices:
        if d.startswith("cuda"):
            index = int(d.split(":")[1]) if ":" in d else 0
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if index >= available:
                raise ValueError(f"devices names {d}, but this machine has {available} CUDA "
                                 f"device(s); list only existing ones (or use cpu)")
    return devices


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, devices: list[str], port: int, threads: int, args: tuple, kwargs: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if devices[rank] == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(threads)
    from .job import run_file_job

    ctx = init_from_env(devices[rank], kwargs.get("dist_timeout", 60.0), rank=rank,
                        world_size=len(devices), local_rank=rank)
    try:
        run_file_job(ctx, *args, **kwargs)
    finally:
        destroy()


def spawn_file_job(device_list: list[str], src, dst, *args, **kwargs) -> Path:
    """Run ``upscale_file`` over several local devices; raises naming the failed rank."""
    import torch.multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // len(device_list))
    try:
        mp.spawn(_worker, args=(device_list, _free_port(), threads, (src, dst, *args), kwargs),
                 nprocs=len(device_list), join=True)
    except mp.ProcessRaisedException as e:
        _remove_partials(dst)
        first = str(e).strip().splitlines()
        raise RuntimeError(f"distributed upscale failed: {first[0] if first else e} "
                           f"(see the traceback above)") from None
    except mp.ProcessExitedException as e:
        _remove_partials(dst)
        raise RuntimeError(f"distributed upscale failed: rank {e.error_index} exited with code "
                           f"{e.exit_code}") from None
    return Path(dst)


def _remove_partials(dst):
    """A rank killed outright cannot clean up; the launcher removes what it left."""
    path = Path(str(dst).rstrip("/"))
    for partial in path.parent.glob(f".{path.name}.partial-*"):
        if partial.is_file():
            partial.unlink(missing_ok=True)
