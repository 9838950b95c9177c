"""Live previews (seedvr2.pipeline.preview): the newest finished frame, as a small thumbnail,
at most about once a second, from every way a job blends its frames: in memory, into a file
(directly or through the resume journal). The spawned ranks' relay is in test_distributed.py,
the nodes in the real ComfyUI in test_comfyui_server.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import seedvr2
from conftest import clip_frame, make_clip
from seedvr2.pipeline.preview import PREVIEW_INTERVAL_S, PREVIEW_MAX_SIDE, FramePreview, thumbnail


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_newest_frame_is_shown_at_most_once_an_interval():
    clock, shown = Clock(), []
    preview = FramePreview(shown.append, clock=clock)
    for t, value in [(0.0, 0.1), (0.5, 0.2), (0.99, 0.3), (1.0, 0.4), (1.7, 0.5), (2.05, 0.6)]:
        clock.now = 100.0 + t
        preview(torch.full((1, 4, 6, 3), value))
    assert PREVIEW_INTERVAL_S == 1.0
    # The first at once, then the frame at hand once a second has passed since the last shown.
    assert [round(s[0, 0, 0].item() / 255, 2) for s in shown] == [0.1, 0.4, 0.6]


@pytest.mark.parametrize("shape, dtype, expected", [
    ((1, 1080, 1920, 3), torch.float32, (288, 512, 3)),
    ((600, 400, 4), torch.float32, (512, 341, 3)),  # RGBA: the alpha is left out
    ((40, 30, 1), torch.uint8, (40, 30, 3)),  # gray, small: three equal channels, not enlarged
])
def test_thumbnail_is_small_rgb_uint8_on_the_cpu(shape, dtype, expected):
    frame = torch.rand(shape) if dtype.is_floating_point else \
        torch.randint(0, 256, shape, dtype=torch.uint8)
    small = thumbnail(frame)
    assert small.shape == expected and small.dtype == torch.uint8 and small.device.type == "cpu"
    assert max(small.shape[:2]) <= PREVIEW_MAX_SIDE
    if shape[-1] == 1:
        assert torch.equal(small, frame.expand(-1, -1, 3))
    if shape == (600, 400, 4):  # 600 rows -> 512: area averaging of the RGB planes
        reference = torch.nn.functional.interpolate(frame[..., :3].permute(2, 0, 1)[None],
                                                    size=(512, 341), mode="area")[0]
        assert torch.equal(small, (reference.permute(1, 2, 0) * 255 + 0.5).to(torch.uint8))


def _options(tiny_options):
    return dict(tiny_options, resolution=32, batch_size=1, temporal_overlap=0,
                text_embeddings=str(tiny_options["model_dir"] / "text_64.safetensors"))


def test_in_memory_job_shows_its_first_finished_frame_then_the_newest(tiny_options):
    frames = torch.from_numpy(np.stack([clip_frame(i) for i in range(3)])).float() / 255
    shown, start = [], time.monotonic()
    out = seedvr2.upscale(frames, **_options(tiny_options), preview=shown.append)
    seconds = time.monotonic() - start
    assert torch.equal(shown[0], thumbnail(out[:1]))  # the first frame, the moment it is final
    thumbs = [thumbnail(out[i:i + 1]) for i in range(len(out))]
    assert all(any(torch.equal(s, t) for t in thumbs) for s in shown)
    assert len(shown) <= 1 + seconds / PREVIEW_INTERVAL_S


@pytest.mark.parametrize("resume", [False, True], ids=["direct", "resumable"])
def test_file_job_shows_the_frames_it_writes(tiny_options, tmp_path, resume):
    """Written directly, or through the resume journal's segments: what is shown is a frame
    the output holds (the PNGs: 8-bit, so within one level of the float frame)."""
    from seedvr2.io import open_media

    clip = tmp_path / "clip.mp4"
    make_clip(clip, frames=5)
    shown = []
    seedvr2.upscale_file(clip, f"{tmp_path}/out/", **_options(tiny_options), resume=resume,
                         preview=shown.append)
    with open_media(f"{tmp_path}/out/%05d.png") as media:
        written = [thumbnail(torch.from_numpy(f)) for f in media.frames()]
    assert shown and (shown[0].int() - written[0].int()).abs().max() <= 1
    assert all(min((s.int() - w.int()).abs().max() for w in written) <= 1 for s in shown)


def test_a_spawned_file_jobs_writer_relays_its_frames_and_previews(tiny_options, tmp_path,
                                                                   monkeypatch):
    """The writer rank of a spawned file job (its worker function, run here as a group of
    one) puts its finished-frame counts and its previews, already small, on the launcher's
    queue; the launcher's relay hands them to ``progress`` and ``preview``."""
    import logging
    import queue
    import shutil

    from seedvr2.distributed import rank_work as dist_job
    from seedvr2.distributed import launch
    from seedvr2.io import open_media
    from seedvr2.options import resolve_options
    from seedvr2.pipeline.job import Job, file_output

    clip = tmp_path / "clip.mp4"
    make_clip(clip, frames=5)
    options = _options(tiny_options)
    model_dir, dit, vae = options.pop("model_dir"), options.pop("dit"), options.pop("vae")
    opts = resolve_options(**options, dist_timeout=30, scene_cuts="off")
    with open_media(clip) as reader:
        output = file_output(reader, f"{tmp_path}/out/", opts)
    started = tmp_path / "started"
    started.mkdir()
    monkeypatch.setenv(dist_job.STARTED_ENV, str(started))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    events = queue.Queue()
    with launch._hosted_store(30.0) as port:
        launch._file_worker(0, ["cpu"], port, torch.get_num_threads(), Job.build(
            opts, dit, vae, model_dir), (clip, output), (logging.WARNING, events, True))
    shutil.rmtree(started)  # the rank's beat thread ends with its folder
    told, shown = [], []
    launch._relayer(events, lambda *event: told.append(event), shown.append)()
    assert told == [("frames", n, 5) for n in range(1, 6)]
    with open_media(f"{tmp_path}/out/%05d.png") as media:
        first = thumbnail(torch.from_numpy(next(iter(media.frames()))))
    assert shown and shown[0].dtype == torch.uint8 and (shown[0].int() - first.int()).abs().max() <= 1
