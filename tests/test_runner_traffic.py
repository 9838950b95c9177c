"""What a batch moves between the host and the compute device, and when the host waits.

``meta`` stands in for the GPU: the tiny models are built there, so a job runs its real
code path without data, and every copy between the host and the device is recorded by
wrapping the ways tensors cross (``Tensor.to``, ``Tensor.copy_``); a copy from ``meta`` to
the host (which has no data to copy) is recorded and answered with an empty host tensor of
the same shape. The CUDA timing path runs with its CUDA calls recorded instead of run.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from seedvr2.api import load_models
from seedvr2.models import build_dit, build_vae
from seedvr2.options import resolve_options
from seedvr2.pipeline import runner as runner_module
from seedvr2.pipeline.plan import make_plan
from seedvr2.pipeline.readahead import ReadAhead
from seedvr2.pipeline.runner import Interrupted, Models, Upscaler

from conftest import constructor_kwargs

META = torch.device("meta")


class Crossings:
    """Copies host -> device (``up``) and device -> host (``down``) as (shape, dtype)."""

    def __init__(self, monkeypatch):
        self.up, self.down = [], []
        real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

        def to(tensor, *args, **kwargs):
            target = _target(args, kwargs)
            if tensor.device.type == "meta" and target is not None and target.type == "cpu":
                self.down.append((tuple(tensor.shape), tensor.dtype))
                dtype = kwargs.get("dtype") or next(
                    (a for a in args if isinstance(a, torch.dtype)), tensor.dtype)
                return torch.empty(tensor.shape, dtype=dtype)
            out = real_to(tensor, *args, **kwargs)
            if tensor.device.type == "cpu" and out.device.type != "cpu":
                self.up.append((tuple(tensor.shape), tensor.dtype))
            return out

        def copy_(dst, src, *args, **kwargs):
            if src.device.type == "cpu" and dst.device.type != "cpu":
                self.up.append((tuple(src.shape), src.dtype))
            return real_copy(dst, src, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


def _target(args, kwargs):
    device = kwargs.get("device")
    if device is None and args and isinstance(args[0], (str, torch.device)):
        device = args[0]
    return torch.device(device) if device is not None else None


def _meta_models(conformance) -> Models:
    with torch.device("meta"):
        dit = build_dit(constructor_kwargs(conformance / "dit3b_tiny")).eval()
        vae = build_vae(constructor_kwargs(conformance / "vae_tiny")).eval()
    text = load_file(conformance / "pipeline" / "e2e_video_9f.safetensors")["inputs.txt_pos"]
    return Models(dit, vae, text, META, META, torch.float32)


@pytest.mark.parametrize("channels", [1, 3])
def test_frames_cross_as_uint8_and_the_reference_stays_on_the_device(conformance, monkeypatch,
                                                                     channels):
    """Before: frames crossed as float32 (4x the bytes), and with the tensors offloaded to
    the host the float32 colour reference at output size went there and back per batch."""
    models = _meta_models(conformance)
    opts = resolve_options(resolution=48, batch_size=5, temporal_overlap=1, device="cpu",
                           dtype="fp32", tensor_offload_device="cpu", color_correction="wavelet",
                           scene_cuts="off")
    frames = torch.randint(0, 256, (9, 24, 32, channels), dtype=torch.uint8)
    plan = make_plan(len(frames), opts)
    out_h, out_w = runner_module.output_size(24, 32, opts)
    crossings = Crossings(monkeypatch)
    outputs = list(Upscaler(models, opts).run(iter(frames), plan))
    assert sum(o.shape[0] for _, o in outputs) == len(frames)
    frame_copies = [c for c in crossings.up if c[0] == (24, 32, channels)]
    # Every plan frame of every batch crosses once, as uint8, and nothing else frame-sized.
    assert frame_copies == [((24, 32, channels), torch.uint8)] * sum(b.frames for b in plan.batches)
    assert not [c for c in crossings.up if out_h in c[0] or c[0][-2:] == (24, 32)]
    # Down: only latents (t, h, w, 16) to the host offload device, then the output frames.
    latents = [c for c in crossings.down if c[0][-1] == 16]
    assert len(latents) == 2 * len(plan.batches)  # encoded, denoised
    assert all(c[0][-1] == 16 or c[0][1:3] == (out_h, out_w) for c in crossings.down)
    assert not [c for c in crossings.down if c[0][1] == 3 and c[0][-2:] == (out_h, out_w)]


def test_integer_frames_give_the_results_of_their_float_values(tiny_options):
    """Frames converted to float on the device equal the job on the same values given as
    float32 (the conversion the host used to do), bit for bit."""
    import seedvr2

    frames = torch.randint(0, 256, (5, 24, 32, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(3))
    run = lambda x: seedvr2.upscale(x, **tiny_options, resolution=48, batch_size=5,  # noqa: E731
                                    text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))
    assert torch.equal(run(frames), run(frames.float() / 255.0))
    frames16 = frames.to(torch.int32).mul(257).to(torch.uint16)
    assert torch.equal(run(frames16.numpy()), run(frames16.float() / 65535.0))


class FakeCuda:
    """torch.cuda's timing calls recorded: events complete when the test says so."""

    def __init__(self, monkeypatch):
        self.syncs, self.event_waits, self.done = 0, 0, False
        fake = self

        class Event:
            clock = 0

            def __init__(self, enable_timing=False):
                Event.clock += 1
                self.at = Event.clock

            def record(self, stream=None):
                pass

            def query(self):
                return fake.done

            def synchronize(self):
                fake.event_waits += 1

            def elapsed_time(self, end):
                return 1000.0 * (end.at - self.at)
        for name, value in dict(Event=Event, current_stream=lambda device=None: None,
                                reset_peak_memory_stats=lambda device=None: None,
                                max_memory_allocated=lambda device=None: 1,
                                max_memory_reserved=lambda device=None: 2).items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.cuda, "synchronize", self._sync)

    def _sync(self, device=None):
        self.syncs += 1


def test_phase_times_on_cuda_need_no_host_sync(conformance, monkeypatch):
    """Before: every phase call ended with torch.cuda.synchronize (the device ran dry while
    the host queued the next phase). Now two events per call, read once they have completed
    (after the consumer fetched the batch) or, at the end of the job, with one wait."""
    models = _meta_models(conformance)
    models.dit_device = models.vae_device = torch.device("cuda", 0)
    upscaler = Upscaler(models, resolve_options(device="cpu"))
    cuda = FakeCuda(monkeypatch)
    for phase in ("encode", "dit", "decode") * 3:
        with upscaler._phase(phase):
            pass
    upscaler._collect_times()
    assert cuda.syncs == 0 and cuda.event_waits == 0 and upscaler.stats.phases["encode"].calls == 0
    assert upscaler.stats.phases["dit"].device_reserved == 2  # peaks: host-side counters
    cuda.done = True
    upscaler._collect_times()
    assert {p: s.calls for p, s in upscaler.stats.phases.items()} == {"encode": 3, "dit": 3, "decode": 3}
    assert upscaler.stats.phases["dit"].seconds == 3.0  # 1 s per call between its events
    assert cuda.syncs == 0 and cuda.event_waits == 0


class Frames:
    """A frame iterator that records the thread and time of each frame read."""

    def __init__(self, frames, fail_at=None):
        self.frames, self.fail_at = frames, fail_at
        self.threads, self.read, self.closed = set(), 0, False

    def __iter__(self):
        try:
            for i, frame in enumerate(self.frames):
                if i == self.fail_at:
                    raise OSError(f"cannot decode frame {i}")
                self.threads.add(threading.get_ident())
                self.read += 1
                yield frame
        finally:
            self.closed = True


def _tiny_upscaler(tiny_options, **options) -> tuple:
    opts = resolve_options(device="cpu", dtype="fp32", resolution=48, batch_size=5,
                           text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"),
                           scene_cuts="off", **options)
    models = load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                         model_dir=tiny_options["model_dir"])
    return models, opts


def _clip(n=13):
    return torch.randint(0, 256, (n, 24, 32, 3), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(5))


def _wait_for(condition, seconds=3.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_frames_are_read_ahead_on_a_thread(tiny_options, monkeypatch):
    """While the first batch encodes, the next batch's frames are read on another thread
    (before: read on the caller's thread, only when a batch needed them)."""
    models, opts = _tiny_upscaler(tiny_options)
    source = Frames(_clip())
    upscaler = Upscaler(models, opts)
    real_encode = upscaler._encode
    seen = []

    def encode(batch, frames, size):
        if batch.start == 0:  # the second batch's frames arrive meanwhile
            seen.append(_wait_for(lambda: source.read >= 10))
        return real_encode(batch, frames, size)
    monkeypatch.setattr(upscaler, "_encode", encode)
    out = torch.cat([o for _, o in upscaler.run(iter(source), make_plan(13, opts))])
    assert seen == [True] and threading.get_ident() not in source.threads
    assert source.closed and out.shape[0] == 13


def test_read_errors_and_cancel_reach_the_job_and_stop_the_reader(tiny_options):
    models, opts = _tiny_upscaler(tiny_options)
    failing = Frames(_clip(), fail_at=7)
    with pytest.raises(OSError, match="^cannot decode frame 7$"):
        list(Upscaler(models, opts).run(iter(failing), make_plan(13, opts)))
    source = Frames(_clip())
    with pytest.raises(Interrupted):
        list(Upscaler(models, opts, should_stop=lambda: source.read >= 3).run(
            iter(source), make_plan(13, opts)))
    assert source.closed and source.read < 13  # the reader stopped and closed its input
    assert not [t for t in threading.enumerate() if t.name == "seedvr2-reader"]


def test_read_ahead_is_bounded():
    source = Frames(range(100))
    reader = ReadAhead(iter(source), depth=4)
    assert next(reader) == 0
    time.sleep(0.2)
    assert source.read <= 1 + 4 + 1  # taken, queued, one waiting to be queued
    reader.close()
    assert source.closed


def test_overlapped_phases_encode_ahead_and_give_identical_frames(tiny_options, monkeypatch):
    """DiT and VAE on different devices: the next batch encodes (on a thread) while the DiT
    runs on the previous one, also across chunks (before: encode, DiT and decode of a chunk
    ran one after the other on the caller's thread); the frames are those of the phases run
    one after the other, bit for bit."""
    models, opts = _tiny_upscaler(tiny_options, temporal_overlap=2)  # one batch per chunk
    clip = _clip()
    plan = make_plan(len(clip), opts)
    assert len(plan.chunks) == len(plan.batches) == 4
    sequential = torch.cat([o for _, o in Upscaler(models, opts).run(iter(clip), plan)])

    upscaler = Upscaler(models, opts)
    upscaler.overlap_phases = True  # both models are on the CPU here: force the schedule
    next_encode_started = {b.start: threading.Event() for b in plan.batches}
    real_encode, real_denoise = upscaler._encode, upscaler._denoise
    overlapped, threads = [], {}

    def encode(batch, frames, size):
        threads.setdefault("encode", threading.get_ident())
        next_encode_started[batch.start].set()
        return real_encode(batch, frames, size)

    def denoise(item):
        threads.setdefault("dit", threading.get_ident())
        later = [b for b in plan.batches if b.start > item.batch.start]
        if later:  # the next batch's encoding has begun before this DiT call ends
            overlapped.append(next_encode_started[later[0].start].wait(timeout=3.0))
        return real_denoise(item)
    monkeypatch.setattr(upscaler, "_encode", encode)
    monkeypatch.setattr(upscaler, "_denoise", denoise)
    out = torch.cat([o for _, o in upscaler.run(iter(clip), plan)])
    assert overlapped == [True] * 3 and threads["encode"] != threads["dit"]
    assert torch.equal(out, sequential)
