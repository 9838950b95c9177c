"""The single-command launcher: ``--devices cuda:0,cuda:1`` (or ``cpu,cpu``) spawns one worker
process per device on this machine, wired into one process group over the loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib
import io
import json
import logging
import multiprocessing.connection
import os
import pickle
import shutil
import stat
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..io.temporaries import abandoned, hold, remove_stale_temporaries
from ..options import OptionError
from ..pipeline.preview import FramePreview
from ..pipeline.runner import Interrupted, JobStats
from .groups import destroy, init_from_env
from .peers import DistributedError
from .rank_work import STARTED_ENV, run_file_job, run_tensor_job

log = logging.getLogger("seedvr2")


def parse_devices(spec: str) -> list[str]:
    """``auto`` = every visible GPU, else one CPU process (``api.process_devices`` decides
    when a named device or loaded models keep a job in one process)."""
    if spec == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    devices = [d.strip() for d in spec.split(",")]
    for d in devices:
        if d.startswith("cuda"):
            index = int(d.split(":")[1]) if ":" in d else 0
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if index >= available:
                raise OptionError(f"devices names {d}, but this machine has {available} CUDA "
                                  f"device(s); list only existing ones (or use cpu)")
    return devices


@contextlib.contextmanager
def _hosted_store(timeout_s: float):
    """The job's rendezvous store, hosted by the launcher (it outlives any rank); yields the
    port the OS picked as it bound (none picked beforehand that another could take)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield store.port
    finally:
        del store  # the last reference: its server stops here, after the workers have ended


def _join_group(rank: int, devices: list[str], port: int, threads: int, timeout_s: float):
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))  # _hosted_store's
    # All ranks are on this machine: gloo connects over the loopback, whatever the host's name.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if devices[rank] == "cpu":
        torch.set_num_threads(threads)
    return init_from_env(devices[rank], timeout_s, rank=rank, world_size=len(devices),
                         local_rank=rank, store=store)


WRITER_STATS = "writer.json"  # in the launch folder: the writer's JobStats for the summary
_WRITER_COUNTS = ("frames", "batches_reused", "batches_total")  # the JobStats it holds


def _file_worker(rank: int, devices: list[str], port: int, threads: int, job, file: tuple,
                 report: tuple):
    log_level, events, previews = report
    # A spawned worker starts without logging set up: show what the parent would, by rank.
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s rank {rank}: %(message)s")
    ctx = _join_group(rank, devices, port, threads, job.opts.dist_timeout)
    stats = JobStats()
    try:
        run_file_job(ctx, _relaying(job, events, previews), *file,
                     progress=functools.partial(_relay_frames, events), stats=stats)
        if ctx.is_writer:
            Path(os.environ[STARTED_ENV], WRITER_STATS).write_text(json.dumps(
                {name: getattr(stats, name) for name in _WRITER_COUNTS}))
    finally:
        destroy()


def _tensor_worker(rank: int, devices: list[str], port: int, threads: int, job,
                   tensors: tuple, channel: tuple):
    ctx = _join_group(rank, devices, port, threads, job.opts.dist_timeout)
    events, stop, previews = channel
    try:
        run_tensor_job(ctx, _relaying(job, events, previews), *tensors,
                       progress=functools.partial(_relay_frames, events),
                       should_stop=stop.is_set)
    finally:
        destroy()


# The writer's events for the launcher: ("frames", done, total), ("preview", (h, w, 3) uint8).
def _relay_frames(events, phase: str, done: int, total: int):
    if phase == "frames":
        events.put((phase, done, total))


def _relaying(job, events, previews: bool):
    """The job with a preview that goes to the launcher, when the launcher shows previews."""
    if not previews:
        return job
    return dataclasses.replace(job, preview=FramePreview(
        lambda thumbnail: events.put(("preview", thumbnail.numpy()))))


def _relayer(events, progress, preview):
    """The launcher's side: each event waiting on ``events`` told to ``progress`` or ``preview``."""
    def relay():
        while True:
            try:
                event = events.get_nowait()
            except Exception:  # queue.Empty
                return
            if event[0] == "preview":
                if preview is not None:
                    preview(torch.from_numpy(event[1]))
            elif progress is not None:
                progress(*event)
    return relay


def _failure(workers, rank: int) -> DistributedError:
    """Which rank failed and, for a raised exception, its last line (the traceback: its stderr)."""
    process = workers.processes[rank]
    try:
        with open(workers.error_files[rank], "rb") as f:
            trace = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return DistributedError(f"distributed upscale failed: rank {rank} exited with code "
                                f"{process.exitcode}")
    lines = [line for line in str(trace).strip().splitlines() if line.strip()]
    return DistributedError(f"distributed upscale failed on rank {rank}: "
                            f"{_in_words(lines[-1].strip()) if lines else trace}")


def _in_words(last: str) -> str:
    """A traceback's last line for a person: our errors' messages alone, another exception
    with its short name."""
    name, colon, message = last.partition(": ")
    if not colon or " " in name:
        return last
    return message if name.startswith("seedvr2.") else f"{name.rpartition('.')[2]}: {message}"


LIBRARY_MODULE = "seedvr2.distributed.launch"  # this module under the library's own name


class _Imported:
    """Pickles as "import this module": how a worker finds its function in the child."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return importlib.import_module, (self.name,)


class _LibraryPickler(pickle.Pickler):
    """Pickles this library's classes and functions (the workers) under its own name: inside
    ComfyUI they live in modules named after the pack's folder path
    (``/…/custom_nodes/X.src.seedvr2.pipeline.job``), which a spawned child cannot import."""

    prefix = __name__[:-len(LIBRARY_MODULE)]  # "/…/X.src." inside ComfyUI, else ""

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)) and \
                obj.__module__.startswith(self.prefix + "seedvr2"):
            return getattr, (_Imported(obj.__module__[len(self.prefix):]), obj.__qualname__)
        return NotImplemented


class _Portable:
    """``value`` (a worker function, a job, an output: our dataclasses) sent to a spawned
    worker, unpickled there under the library's own module names (:class:`_LibraryPickler`)."""

    def __init__(self, value):
        buffer = io.BytesIO()
        _LibraryPickler(buffer).dump(value)
        self.data = buffer.getvalue()

    def __reduce__(self):
        return pickle.loads, (self.data,)


def _portable(value):
    return value if __name__ == LIBRARY_MODULE else _Portable(value)


@contextlib.contextmanager
def _spawnable():
    """While workers start: hide the parent's ``__main__`` (inside ComfyUI ``main.py``, whose
    top level runs every prestartup script), and when the library is not importable as
    ``seedvr2`` (a custom-node folder) append its folder to the ``sys.path`` the children copy."""
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


LAUNCH_PREFIX = "seedvr2-ranks-"  # launch folders, in the system's temporary folder
# A launch folder is locked a moment after it is made: a younger one may be a live launcher's.
LAUNCH_FOLDER_GRACE_S = 60.0


def remove_stale_launch_folders() -> list[Path]:
    """Remove (and return) the launch folders of launchers killed before their cleanup: a live
    launcher holds a lock on its folder (:func:`hold`, dropped by the kernel when it dies)."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{LAUNCH_PREFIX}*"):
        try:
            info = folder.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or \
                time.time() - info.st_mtime < LAUNCH_FOLDER_GRACE_S:
            continue
        if not abandoned(folder):
            continue  # held by a live launcher (or no locks on this filesystem: leave it)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        log.debug("removed launch folders left by killed launchers: %s",
                  ", ".join(map(str, removed)))
    return removed


@contextlib.contextmanager
def _launched(worker, device_list: list[str], timeout_s: float, args: tuple):
    """Spawn one ``worker(rank, device_list, port, threads, *args)`` per device; yields the
    workers and the launch folder (``rank_work._mark_started``). On leaving, every worker has
    ended (:func:`_stop`), then the store and the folder go."""
    remove_stale_launch_folders()
    with tempfile.TemporaryDirectory(prefix=LAUNCH_PREFIX) as started, \
            _hosted_store(timeout_s) as port, contextlib.ExitStack() as held:
        lock = hold(Path(started))  # a live launcher's (remove_stale_launch_folders)
        if lock is not None:
            held.callback(lock.release)
        previous = os.environ.get(STARTED_ENV)
        os.environ[STARTED_ENV] = started  # the children's environment is ours at spawn
        threads_per_rank = max(1, (os.cpu_count() or 1) // len(device_list))
        try:
            with _spawnable():
                workers = mp.start_processes(
                    _portable(worker), args=(device_list, port, threads_per_rank, *args),
                    nprocs=len(device_list), join=False, start_method="spawn")
        finally:
            if previous is None:
                os.environ.pop(STARTED_ENV, None)
            else:
                os.environ[STARTED_ENV] = previous
        try:
            yield workers, Path(started)
        finally:
            _stop(workers)


def spawn_file_job(device_list: list[str], job, src, output, stats=None, progress=None,
                   preview=None) -> Path:
    """Run ``upscale_file`` over several local devices; raises naming the failed rank. ``stats``
    is told the writer's counts and the ranks lost, ``progress`` and ``preview`` its frames."""

    timeout_s = job.opts.dist_timeout
    events = mp.get_context("spawn").Queue()
    relay = _relayer(events, progress, preview)
    with _launched(_file_worker, device_list, timeout_s,
                   (_portable(job), _portable((src, output)),
                    (log.getEffectiveLevel(), events, preview is not None))) \
            as (workers, started):
        try:
            lost = _join(workers, timeout_s, started, relay)
            relay()
        finally:
            _stop(workers)
            # Only now that no worker lives: a rank killed outright left its temporaries behind.
            remove_stale_temporaries(output.dst)
        if stats is not None:
            written = started / WRITER_STATS
            if written.is_file():
                writer = json.loads(written.read_text())
                for name in _WRITER_COUNTS:
                    setattr(stats, name, writer[name])
            stats.ranks_lost = lost
    return Path(output.dst)


def _join(workers, timeout_s: float, started: Path, tick=None):
    """Wait for the job; returns the ranks it went on without (rank -> exit code). Raises
    naming the rank when the writer (rank 0) fails or freezes (its mark stops moving for
    ``timeout_s``) or a rank fails before it has started; a rank still running ``timeout_s``
    after the output is complete is stopped. docs/multi-gpu.md#when-a-rank-is-lost."""
    processes = workers.processes
    lost: dict[int, int] = {}  # rank -> exit code: the ranks the job went on without
    ended: set[int] = set()  # ranks whose failure is dealt with
    writer_done = None  # when the output was complete
    while True:
        if tick is not None:
            tick()
        if writer_done is None and (processes[0].exitcode == 0 or (started / "done").exists()):
            writer_done = time.monotonic()
        for rank, process in enumerate(processes):
            code = process.exitcode  # polls (and reaps) without blocking
            if code in (None, 0) or rank in ended:
                continue
            ended.add(rank)
            if rank == 0 and writer_done is not None:  # failed leaving the group
                log.warning("rank 0 exited with code %d after the output was complete", code)
            elif rank == 0 or not (started / f"rank{rank}").exists():
                _stop_after_grace(processes)
                raise _failure(workers, rank)
            else:
                lost[rank] = code
                log.warning("rank %d exited with code %d during the job; the others finish "
                            "its work", rank, code)
        if all(p.exitcode is not None for p in processes):
            break
        writer_mark = started / "rank0"
        if writer_done is None and processes[0].exitcode is None and writer_mark.exists() and \
                time.time() - writer_mark.stat().st_mtime > timeout_s:
            _stop(workers)  # SIGKILL reaches a frozen process; SIGTERM would wait
            raise DistributedError(f"distributed upscale failed: rank 0 (the writer) has shown "
                                   f"no sign of life for dist_timeout ({timeout_s:g}s): frozen "
                                   f"or hung")
        if writer_done is not None and time.monotonic() - writer_done > timeout_s:
            stuck = [r for r, p in enumerate(processes) if p.is_alive()]
            log.warning("rank(s) %s did not exit within dist_timeout (%gs) of the finished "
                        "output; stopped", stuck, timeout_s)
            break
        multiprocessing.connection.wait([p.sentinel for p in processes if p.is_alive()], 0.2)
    if lost:
        log.warning("the job finished without rank(s) %s: every frame was computed by the "
                    "others and is written", ", ".join(map(str, sorted(lost))))
    return lost


def _stop_after_grace(processes):
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


# When one rank fails the others get this long to clean up after themselves, then SIGTERM
# and as long again, then SIGKILL: a frozen rank (hung driver, SIGSTOP) ignores SIGTERM, and
# the whole command must end within dist_timeout and a few seconds.
STOP_GRACE_S = 2.0


def _stop(workers):
    """End every worker still running (an error must not orphan them): SIGTERM, then SIGKILL."""
    alive = [p for p in workers.processes if p.is_alive()]
    for process in alive:
        process.terminate()
    for process in alive:
        process.join(STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


def spawn_tensor_job(device_list: list[str], job, frames: torch.Tensor, out_shape: tuple,
                     progress=None, should_stop=None, preview=None) -> torch.Tensor:
    """Run ``upscale`` over several local devices, spawned (the parent may have initialised
    CUDA), the frames both ways in shared memory; ``should_stop`` is relayed to every worker."""
    if frames.device.type != "cpu":
        frames = frames.cpu()
    if not frames.is_shared():
        frames.share_memory_()  # in place, no second copy
    out = torch.empty(out_shape, dtype=torch.float32).share_memory_()
    spawning = mp.get_context("spawn")
    events, stop = spawning.Queue(), spawning.Event()
    relay = _relayer(events, progress, preview)

    def tick():
        relay()
        if should_stop is not None and not stop.is_set() and should_stop():
            stop.set()
    timeout_s = job.opts.dist_timeout
    with _launched(_tensor_worker, device_list, timeout_s,
                   (_portable(job), (frames, out), (events, stop, preview is not None))) \
            as (workers, started):
        try:
            _join(workers, timeout_s, started, tick)
        except RuntimeError:
            if stop.is_set():
                raise Interrupted("upscaling interrupted") from None
            raise
    relay()
    return out
