"""Frame-parallel upscaling over gloo on the CPU: same frames as one process, clean failures."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from seedvr2.distributed import assign_batches
from seedvr2.io import open_media
from seedvr2.options import resolve_options
from seedvr2.pipeline.plan import make_plan

from conftest import REPO, make_clip

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_assignment_deals_chunks_in_turn():
    plan = make_plan(40, resolve_options(scene_cuts="off", batch_size=5, chunk_size=10))
    shares = assign_batches(plan, 3)
    assert shares == [[0, 1, 6, 7], [2, 3], [4, 5]]
    assert sorted(sum(shares, [])) == list(range(len(plan.batches)))
    assert assign_batches(make_plan(3, resolve_options(scene_cuts="off")), 4)[1:] == [[], [], []]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "clip.mp4"
    make_clip(path, frames=23)  # 23 frames in batches of 5: a batch count no rank count divides
    return path


def _cli(tiny_options, src, dst, *extra, env=None, timeout=300, quiet=True):
    cmd = [sys.executable, "-m", "seedvr2", "upscale", str(src), "-o", dst,
           *(["--quiet"] if quiet else []),
           "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
           "--model-dir", str(tiny_options["model_dir"]), "--dtype", "fp32",
           "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
           "--resolution", "32", "--batch-size", "5", "--temporal-overlap", "1",
           "--dist-timeout", "10", *extra]
    environment = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=environment,
                          timeout=timeout)


def _frames(folder):
    with open_media(f"{folder}/%05d.png") as media:
        return np.stack(list(media.frames()))


@pytest.fixture(scope="module")
def single(clip, tiny_options, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    result = _cli(tiny_options, clip, f"{out}/", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    return _frames(out)


@pytest.mark.parametrize("devices", ["cpu,cpu", "cpu,cpu,cpu"])
def test_ranks_give_identical_frames(clip, tiny_options, tmp_path, single, devices):
    result = _cli(tiny_options, clip, f"{tmp_path}/out/", "--devices", devices)
    assert result.returncode == 0, result.stderr
    frames = _frames(tmp_path / "out")
    assert frames.shape == single.shape == (23, 32, 42, 3)
    assert np.array_equal(frames, single)


@pytest.mark.parametrize("after", [1, 2])
def test_dead_rank_is_taken_over_with_identical_frames(clip, tiny_options, tmp_path, single,
                                                       after):
    """Rank 1 dies without any cleanup (as kill -9 would) after delivering one batch — the
    second batch of its chunk is lost with it, and the writer computes it — or two (its whole
    chunk: the writer takes the rest). The job finishes with the frames of one process, and
    the log says what happened."""
    start = time.monotonic()
    result = _cli(tiny_options, clip, f"{tmp_path}/out/", "--devices", "cpu,cpu",
                  "--chunk-size", "9",  # chunks of two batches: [0, 1], [2, 3], [4, 5]
                  env={"SEEDVR2_FAULT": f"1:after_batches={after}"}, quiet=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - start < 120
    assert "rank 1 exited with code 17 during the job" in result.stderr, result.stderr[-3000:]
    assert "the job finished without rank(s) 1" in result.stderr
    assert "23 frames in" in result.stdout, result.stdout
    assert ("without rank 1 (exit code 17) from then on: the others computed its batches"
            in result.stdout), result.stdout
    redone = "rank 1 exited: rank 0 computed its 1 unfinished batch(es) itself"
    assert (redone in result.stderr) == (after == 1), result.stderr[-3000:]
    assert np.array_equal(_frames(tmp_path / "out"), single)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left


def test_writer_death_fails_the_job_without_output(clip, tiny_options, tmp_path):
    result = _cli(tiny_options, clip, str(tmp_path / "out.mp4"), "--devices", "cpu,cpu",
                  "--chunk-size", "9", env={"SEEDVR2_FAULT": "0:after_batches=1"})
    assert result.returncode != 0
    assert "rank 0" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no output, no partial file


def test_devices_option_errors():
    with pytest.raises(ValueError, match="mixes CPU and GPU devices"):
        resolve_options(devices="cpu,cuda:0")
    from seedvr2.distributed.launch import parse_devices
    with pytest.raises(ValueError, match=r"devices names cuda:7, but this machine has 0 CUDA device"):
        parse_devices("cuda:7")
    assert parse_devices("auto") == ["cpu"]


def test_launcher_holds_the_rendezvous_port_while_the_job_runs():
    """The launcher hosts the job's store on a port the OS gave it, before any worker starts:
    no other process can take that port before rank 0 has started (it used to be picked free,
    closed, and bound by rank 0 seconds later). Workers reach the store; it ends with the job."""
    import datetime
    import socket

    import torch.distributed as dist

    from seedvr2.distributed.launch import _hosted_store

    def bind(port: int):
        with socket.socket() as other:
            # Connections closed by the store leave TIME_WAIT entries: they must not count.
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))

    with _hosted_store(5.0) as port:
        with pytest.raises(OSError, match="Address already in use"):
            bind(port)
        worker = dist.TCPStore("127.0.0.1", port, is_master=False,
                               timeout=datetime.timedelta(seconds=5))
        worker.set("rank1", "here")
        assert worker.get("rank1") == b"here"
        del worker
    bind(port)  # the store has stopped listening


# -- frames in memory (the ComfyUI node's path): shared memory in and out ---------------------

@pytest.fixture(scope="module")
def memory_frames():
    import torch

    from conftest import clip_frame
    return torch.from_numpy(np.stack([clip_frame(i) for i in range(13)])).float() / 255


def _memory_options(tiny_options):
    return dict(tiny_options, resolution=32, batch_size=5, temporal_overlap=1, dist_timeout=10)


def test_in_memory_ranks_match_one_process(tiny_options, memory_frames, monkeypatch):
    import torch

    import seedvr2
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs: the same reduction order, the same bits
    try:
        one = seedvr2.upscale(memory_frames, **_memory_options(tiny_options))
    finally:
        torch.set_num_threads(threads)
    seen, shown = [], []
    two = seedvr2.upscale(memory_frames.clone(), **_memory_options(tiny_options), devices="cpu,cpu",
                          progress=lambda *event: seen.append(event), preview=shown.append)
    assert two.shape == one.shape == (13, 32, 42, 3)
    assert torch.equal(two, one)
    assert seen and seen[-1] == ("frames", 13, 13)
    assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen)
    # The writer rank's previews reach the launcher: its first finished frame, small.
    from seedvr2.pipeline.preview import thumbnail
    assert shown and torch.equal(shown[0], thumbnail(two[:1]))


def test_in_memory_job_finishes_without_a_dead_rank(tiny_options, memory_frames, monkeypatch):
    """The ComfyUI upscaler's several devices: a worker that dies mid-job is taken over too."""
    import torch

    import seedvr2
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = seedvr2.upscale(memory_frames, **_memory_options(tiny_options), chunk_size=9)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("SEEDVR2_FAULT", "1:after_batches=1")  # the spawned workers inherit it
    two = seedvr2.upscale(memory_frames.clone(), **_memory_options(tiny_options), chunk_size=9,
                          devices="cpu,cpu")
    assert torch.equal(two, one)


def test_in_memory_interrupt_and_failure(tiny_options, memory_frames, monkeypatch):
    import seedvr2
    from seedvr2.pipeline.runner import Interrupted
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    # The stop request is relayed long before the spawned workers (importing torch) start work.
    with pytest.raises(Interrupted, match="upscaling interrupted"):
        seedvr2.upscale(memory_frames, **_memory_options(tiny_options), devices="cpu,cpu",
                        should_stop=lambda: True)
    options = dict(_memory_options(tiny_options), dit=str(tiny_options["model_dir"] / "missing.safetensors"))
    with pytest.raises(RuntimeError, match=r"distributed upscale failed on rank [01]: .*missing\.safetensors"):
        seedvr2.upscale(memory_frames, **options, devices="cpu,cpu")


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_nccl_world_size_one_runs_the_distributed_path(clip, tiny_options, tmp_path):
    """On a one-GPU machine: the rank code path over NCCL (world size 1) gives the frames of
    the plain single-process run on the same GPU (within one 8-bit level)."""
    from seedvr2.distributed.launch import spawn_file_job

    options = dict(tiny_options, device="cuda:0", resolution=32, batch_size=5, temporal_overlap=1,
                   dist_timeout=30, scene_cuts="off")
    import seedvr2
    seedvr2.upscale_file(clip, f"{tmp_path}/one/", **options)
    model_dir = options.pop("model_dir")
    dit, vae = options.pop("dit"), options.pop("vae")
    from seedvr2.io import open_media
    from seedvr2.pipeline.job import Job, file_output

    opts = resolve_options(**options)
    with open_media(clip) as reader:
        output = file_output(reader, f"{tmp_path}/nccl/", opts)
    spawn_file_job(["cuda:0"], Job.build(opts, dit, vae, model_dir), clip, output)
    one, nccl = _frames(tmp_path / "one"), _frames(tmp_path / "nccl")
    assert one.shape == nccl.shape
    assert np.abs(one.astype(int) - nccl.astype(int)).max() <= 1


def test_sequence_parallel_ranks_give_identical_frames(clip, tiny_options, tmp_path, single):
    """Two ranks share every batch's DiT call (Ulysses) and split the VAE work: each batch of
    a chunk is encoded and decoded by one rank in turn (both ranks used to run the VAE on
    every batch). The frames are those of one process."""
    import re

    from seedvr2.distributed.vae_share import vae_owners

    result = _cli(tiny_options, clip, f"{tmp_path}/out/", "--devices", "cpu,cpu",
                  "--sequence-parallel", "2", "--chunk-size", "10", "-v")
    assert result.returncode == 0, result.stderr
    assert np.array_equal(_frames(tmp_path / "out"), single)
    encoded = [(int(rank), int(batch)) for rank, batch in re.findall(
        r"rank (\d+): VAE of batch (\d+): encoded and decoded on this rank", result.stderr)]
    plan = make_plan(23, resolve_options(batch_size=5, temporal_overlap=1, chunk_size=10,
                                         scene_cuts="off"))
    assert [len(c) for c in plan.chunks] == [2, 2, 2]
    assert sorted(encoded) == sorted((r, b) for b, r in vae_owners(plan, 2).items())
    assert {r for r, _ in encoded} == {0, 1} and len(encoded) == len(plan.batches)


def test_sequence_parallel_checks(clip, tiny_options, tmp_path):
    import seedvr2
    from seedvr2.options import OptionError
    with pytest.raises(OptionError, match=r"sequence_parallel = 2 needs as many ranks: list the devices"):
        seedvr2.upscale_file(clip, tmp_path / "out.mp4", **tiny_options, sequence_parallel=2)
    # Three ranks share the tiny DiT's two heads: refused by the installed Ulysses strategy.
    result = _cli(tiny_options, clip, str(tmp_path / "out.mp4"), "--devices", "cpu,cpu,cpu",
                  "--sequence-parallel", "3")
    assert result.returncode != 0
    assert "sequence parallelism over 3 ranks needs a head count divisible by 3; this DiT has 2 heads" in result.stderr, result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


class _Reached(Exception):
    """Raised by a stand-in load_models: the facade chose one process with these options."""

    def __init__(self, opts):
        super().__init__(opts.device)
        self.opts = opts


def _two_gpus(monkeypatch):
    """A machine with two GPUs as the facade sees it; nothing may be spawned on it."""
    import torch

    from seedvr2 import api
    from seedvr2.distributed import launch
    from seedvr2.pipeline.job import Job

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def spawned(devices, *args, **kwargs):
        raise AssertionError(f"spawned workers on {devices}")
    monkeypatch.setattr(launch, "spawn_tensor_job", spawned)
    monkeypatch.setattr(launch, "spawn_file_job", spawned)

    def load_models(dit, vae, opts, model_dir=None):
        raise _Reached(opts)
    monkeypatch.setattr(api, "load_models", load_models)  # the command's, once per run
    monkeypatch.setattr(Job, "prepare", lambda job, *args, **kwargs: load_models(
        None, None, job.opts))  # a job's set-up, before it measures a device


@pytest.mark.parametrize("option, value", [("device", "cuda:0"), ("device", "cuda:1"),
                                           ("dit_device", "cuda:1"), ("vae_device", "cuda:0")])
def test_an_explicit_device_runs_one_process_under_devices_auto(monkeypatch, option, value):
    """devices=auto on a machine with several GPUs spread the job over all of them even when
    a device was named: a named device means one process, there."""
    import torch

    import seedvr2

    _two_gpus(monkeypatch)
    with pytest.raises(_Reached) as reached:
        seedvr2.upscale(torch.rand(5, 16, 16, 3), **{option: value})
    assert getattr(reached.value.opts, option) == value
    assert reached.value.opts.device == (value if option == "device" else "auto")


def test_loaded_modules_run_one_process_on_their_device_under_devices_auto(monkeypatch):
    """Loaded modules cannot travel to worker processes: with devices=auto they raised
    ValueError on a machine with several GPUs; now one process runs on the modules' GPU
    (or, for modules on the CPU, where device=auto puts them)."""
    import types

    import torch

    import seedvr2
    from seedvr2.api import process_devices

    _two_gpus(monkeypatch)
    on_cpu = torch.nn.Linear(2, 2)
    with pytest.raises(_Reached) as reached:
        seedvr2.upscale(torch.rand(5, 16, 16, 3), dit=on_cpu, vae="vae.safetensors")
    assert reached.value.opts.device == "auto"

    class OnSecondGpu(torch.nn.Module):
        def parameters(self, recurse=True):
            yield types.SimpleNamespace(device=torch.device("cuda", 1))
    devices, opts = process_devices(resolve_options(), "dit.safetensors", OnSecondGpu())
    assert devices == ["cuda:1"] and opts.device == "cuda:1"
    # Nothing tied to a device: every GPU; a list given explicitly is obeyed.
    assert process_devices(resolve_options(), None, None)[0] == ["cuda:0", "cuda:1"]
    assert process_devices(resolve_options(devices="cuda:1"), None, None)[1].device == "cuda:1"
    with pytest.raises(ValueError, match="several devices need the models by name or path"):
        seedvr2.upscale(torch.rand(5, 16, 16, 3), dit=on_cpu, devices="cuda:0,cuda:1")


def test_cli_with_a_named_device_loads_the_models_once_in_this_process(monkeypatch, tmp_path,
                                                                       clip):
    """The command decides one process or several as the facade does: with --device cuda:1
    on a two-GPU machine it loads the models itself (once for every input), with the device."""
    from seedvr2 import cli

    _two_gpus(monkeypatch)
    with pytest.raises(_Reached) as reached:  # the stand-in load_models, in this process
        cli.main(["upscale", str(clip), "-o", str(tmp_path / "out.mp4"), "--device", "cuda:1",
                  "--quiet"])
    assert reached.value.opts.device == "cuda:1"
    # Loaded by the command itself (then reused for every input), not per file by upscale_file.
    assert reached.traceback[-2].name == "_run_jobs"


def _recorded_groups(monkeypatch, backend: str, dist_timeout: float):
    """The (args, kwargs) of every process group a rank makes: the default group
    (init_from_env on ``backend``'s device) and the job's groups (Links.make, sequence
    parallelism of 2 in a world of 4), recorded instead of made."""
    import torch
    import torch.distributed as dist

    from seedvr2.distributed import groups
    from seedvr2.distributed import rank_work as job

    made = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: made.append((a, k)))
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append((a, k)) or object())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(job, "JobKeys", lambda: None)
    monkeypatch.setattr(job, "Liveness", lambda keys, timeout_s: None)
    ctx = groups.init_from_env("cuda:0" if backend == "nccl" else "cpu", dist_timeout, rank=1,
                               world_size=4, local_rank=1, store=object())
    job.Links.make(ctx, resolve_options(sequence_parallel=2, dist_timeout=dist_timeout))
    return made


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_groups_wait_longer_than_any_forward(monkeypatch, backend):
    """NCCL's watchdog counts a collective's timeout from when the CPU enqueued it, and the CPU
    runs up to a whole DiT forward ahead of the GPU: with dist_timeout (60 s) a forward over a
    minute would abort the group. NCCL groups (the default group, the sequence group, which
    inherits its backend) wait an hour or more; gloo groups, whose waits start with the call,
    keep dist_timeout (a lost peer is the Lifeline's and the polled waits' to find)."""
    import datetime

    minute = datetime.timedelta(seconds=60)
    made = _recorded_groups(monkeypatch, backend, 60.0)
    (default_args, default), *job_groups = made
    assert default_args == (backend,)
    assert len(job_groups) == 2 + 2 + 1  # sequence groups, meeting groups, the frame group
    for args, kwargs in [((), default), *job_groups]:
        gloo = kwargs.get("backend", backend) == "gloo"
        if gloo:
            assert kwargs["timeout"] == minute, (args, kwargs)
        else:
            assert kwargs["timeout"] >= datetime.timedelta(hours=1), (args, kwargs)
    assert sum(k.get("backend", backend) == "nccl" for _, k in made) == \
        (3 if backend == "nccl" else 0)
