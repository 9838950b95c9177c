"""The single-command launcher: ``--devices cuda:0,cuda:1`` (or ``cpu,cpu``) spawns one worker
process per device on this machine, wired into one process group over the loopback."""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
import types
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


def _join_group(rank: int, devices: list[str], port: int, threads: int, timeout_s: float):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Every rank is on this machine: gloo (the whole group on CPUs, the frame group on GPUs
    # too) connects over the loopback, whatever the host name resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if devices[rank] == "cpu":
        torch.set_num_threads(threads)
    return init_from_env(devices[rank], timeout_s, rank=rank, world_size=len(devices),
                         local_rank=rank)


def _file_worker(rank: int, devices: list[str], port: int, threads: int, args: tuple, kwargs: dict):
    from .job import run_file_job

    ctx = _join_group(rank, devices, port, threads, kwargs.get("dist_timeout", 60.0))
    try:
        run_file_job(ctx, *args, **kwargs)
    finally:
        destroy()


def _tensor_worker(rank: int, devices: list[str], port: int, threads: int, frames, out, models,
                   events, stop, kwargs: dict):
    from .job import run_tensor_job

    ctx = _join_group(rank, devices, port, threads, kwargs.get("dist_timeout", 60.0))

    def report(phase: str, done: int, total: int):
        if phase == "frames":  # only the writer rank counts finished frames
            events.put((phase, done, total))
    try:
        run_tensor_job(ctx, frames, out, *models, progress=report, should_stop=stop.is_set,
                       **kwargs)
    finally:
        destroy()


def _threads_per_rank(device_list: list[str]) -> int:
    return max(1, (os.cpu_count() or 1) // len(device_list))


def _failure(e: Exception, dst=None) -> RuntimeError:
    """The launcher's error: which rank failed and, for a raised exception, its last line
    (the worker's full traceback stays in the exception text and on stderr)."""
    import torch.multiprocessing as mp

    if dst is not None:
        _remove_partials(dst)
    if isinstance(e, mp.ProcessExitedException):
        return RuntimeError(f"distributed upscale failed: rank {e.error_index} exited with code "
                            f"{e.exit_code}")
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return RuntimeError(f"distributed upscale failed on rank {e.error_index}: "
                        f"{lines[-1].strip() if lines else e}")


LIBRARY_MODULE = "seedvr2.distributed.launch"  # this module under the library's own name


class _Imported:
    """Pickles as "import this module": how a worker finds its function in the child."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return importlib.import_module, (self.name,)


class _WorkerFunction:
    """A worker function of this module, pickled by the library's name. Inside ComfyUI this
    module is imported under the pack's folder path (``/…/custom_nodes/X.src.seedvr2…``),
    which a spawned child cannot import; it imports ``seedvr2`` instead."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return getattr, (_Imported(LIBRARY_MODULE), self.name)


@contextlib.contextmanager
def _spawnable():
    """While workers start: hide the parent's ``__main__`` (inside ComfyUI that is ``main.py``,
    whose top level runs every custom node's prestartup script; the workers need nothing from
    it), and when the library is not importable as ``seedvr2`` (a ComfyUI custom-node folder),
    give the children's ``sys.path`` — a copy of ours taken at start — the library's folder,
    appended last and removed again as soon as they have started."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    library_root = str(Path(__file__).resolve().parents[2])
    added = __name__ != LIBRARY_MODULE and library_root not in sys.path
    if added:
        sys.path.append(library_root)
    try:
        yield
    finally:
        sys.modules["__main__"] = main
        if added:
            sys.path.remove(library_root)


def _start(worker, args: tuple, nprocs: int):
    import torch.multiprocessing as mp

    with _spawnable():
        return mp.start_processes(_WorkerFunction(worker.__name__), args=args, nprocs=nprocs,
                                  join=False, start_method="spawn")


def spawn_file_job(device_list: list[str], src, dst, *args, **kwargs) -> Path:
    """Run ``upscale_file`` over several local devices; raises naming the failed rank."""
    import torch.multiprocessing as mp

    workers = _start(_file_worker, (device_list, _free_port(), _threads_per_rank(device_list),
                                    (src, dst, *args), kwargs), len(device_list))
    try:
        while not workers.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        raise _failure(e, dst) from None
    finally:
        _stop(workers)
    return Path(dst)


def _stop(workers):
    for process in workers.processes:  # an error here (or in a callback) must not orphan them
        if process.is_alive():
            process.terminate()


def spawn_tensor_job(device_list: list[str], frames: torch.Tensor, out_shape: tuple, dit=None,
                     vae=None, *, progress=None, should_stop=None, **kwargs) -> torch.Tensor:
    """Run ``upscale`` on frames in memory over several local devices.

    Frames go to the workers and results come back through shared memory (no pickling of
    the video); the writer rank reports finished frames to ``progress`` here, and
    ``should_stop`` is polled here and relayed to every worker. Works from a parent that has
    already initialised CUDA (ComfyUI): the workers are spawned, not forked.
    """
    import torch.multiprocessing as mp

    from ..pipeline.runner import Interrupted

    if frames.device.type != "cpu":
        frames = frames.cpu()
    if not frames.is_shared():
        frames.share_memory_()  # moves the storage into shared memory in place, no second copy
    out = torch.empty(out_shape, dtype=torch.float32).share_memory_()
    spawn = mp.get_context("spawn")
    events, stop = spawn.Queue(), spawn.Event()

    def relay():
        while True:
            try:
                event = events.get_nowait()
            except Exception:  # queue.Empty
                return
            if progress is not None:
                progress(*event)
    workers = _start(_tensor_worker, (device_list, _free_port(), _threads_per_rank(device_list),
                                      frames, out, (dit, vae), events, stop, kwargs),
                     len(device_list))
    try:
        while not workers.join(timeout=0.2):
            relay()
            if should_stop is not None and not stop.is_set() and should_stop():
                stop.set()
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        if stop.is_set():
            raise Interrupted("upscaling interrupted") from None
        raise _failure(e) from None
    finally:
        _stop(workers)
    relay()
    return out


def _remove_partials(dst):
    """A rank killed outright cannot clean up; the launcher removes what it left."""
    path = Path(str(dst).rstrip("/"))
    for partial in path.parent.glob(f".{path.name}.partial-*"):
        if partial.is_file():
            partial.unlink(missing_ok=True)
