"""Scene cuts: detection on clips made here, a plan whose batches never cross a cut, shots
upscaled independently of each other, and the same file from 1 or 2 ranks and a resumed run."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from seedvr2.options import OptionError, resolve_options
from seedvr2.pipeline import cuts
from seedvr2.pipeline.plan import Batch, BatchPlan, make_plan, next_4n1

from conftest import FPS, clip_frame

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H, W = 48, 64
CUTS = (7, 13, 22)  # mid-batch for batches of 5 (and of 9)
SHORT_SHOTS = 4  # a min_scene_length the clip's shots pass (15 would merge them)


def pattern(seed: int, shift: float = 0.0) -> np.ndarray:
    """Smooth random waves in a palette of the seed's own (a shot), moved ``shift`` px."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.arange(H).float()[:, None], torch.arange(W).float()[None, :] + shift
    channels = []
    for _ in range(3):
        f1, f2, phase = (torch.rand(3, generator=g) * torch.tensor([0.3, 0.3, 6.28])).tolist()
        base = 0.25 + 0.5 * torch.rand(1, generator=g).item()
        channels.append(base + 0.2 * torch.sin(x * f1 + y * f2 + phase)
                        * torch.cos(y * f1 * 0.7 - x * f2 * 0.5))
    return (torch.stack(channels, -1).clamp(0, 1) * 255).round().to(torch.uint8).numpy()


def flat(rgb) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, np.uint8), (H, W, 3)).copy()


def cut_clip(first_shot=None) -> np.ndarray:
    """26 frames: a panning pattern, a flat colour, another panning pattern, another flat
    colour; cuts at :data:`CUTS`. ``first_shot(i)`` replaces the frames before the first cut."""
    shot = first_shot or (lambda i: pattern(1, shift=i))
    frames = [shot(i) for i in range(7)] + [flat((200, 80, 50))] * 6
    frames += [pattern(2, shift=i) for i in range(9)] + [flat((50, 80, 200))] * 4
    return np.stack(frames)


def test_detection_finds_exactly_the_cuts():
    assert cuts.detect_cuts(cut_clip()) == CUTS
    assert cuts.detect_cuts(torch.from_numpy(cut_clip()).float() / 255) == CUTS  # any precision
    assert cuts.detect_cuts(cut_clip(), SHORT_SHOTS) == CUTS
    assert cuts.detect_cuts(cut_clip(), 7) == (7, 22)  # 13 is 6 frames after 7: too short
    assert cuts.detect_cuts(cut_clip(), 8) == (13, 22)  # the first shot too


def test_no_cut_in_a_pan_a_lighting_step_or_a_brighter_flat_colour():
    pan = [pattern(3, shift=i * 2).astype(int) for i in range(30)]  # 2 px a frame
    brighter = [np.clip(f * 1.6, 0, 255) for f in pan[10:20]]  # the light steps up, ...
    lower_contrast = [(f - 128) * 0.6 + 128 for f in pan[20:]]  # ... then the contrast down
    assert cuts.detect_cuts([f.astype(np.uint8) for f in pan[:10] + brighter + lower_contrast]) \
        == ()
    assert cuts.detect_cuts([flat((100, 25, 25))] * 3 + [flat((200, 50, 50))] * 3) == ()
    # The suite's test clip: a thin line moving fast over a frame that brightens.
    assert cuts.detect_cuts([clip_frame(i) for i in range(60)]) == ()


def _faded(frames, gains):
    return [(f.astype(float) * g).round().astype(np.uint8) for f, g in zip(frames, gains)]


def _auto_cuts(frames, **options) -> tuple:
    """The cuts scene_cuts=auto finds with the default options and ``options``."""
    return cuts.resolve_scene_cuts(resolve_options(**options), len(frames),
                                   lambda: iter(frames)).scene_cuts


def test_a_flash_is_no_cut():
    """One white frame, or two over-exposed ones, in a steady shot: two changes that return
    to the shot; cutting there split the shot where nothing changed (issue 33)."""
    shot = [pattern(1, shift=i) for i in range(40)]
    white = shot[:20] + [flat((255, 255, 255))] + shot[21:]
    features = [cuts.frame_features(f) for f in white[19:22]]
    assert cuts.is_cut(*features[:2]) and cuts.is_cut(*features[1:])  # each alone a cut ...
    assert _auto_cuts(white) == ()  # ... together they are a flash
    bright = shot[:20] + [np.clip(f.astype(int) + 150, 0, 255).astype(np.uint8)
                          for f in shot[20:22]] + shot[22:]
    assert _auto_cuts(bright) == ()
    assert _auto_cuts(white, min_scene_length=15) == ()
    # Two frames of another shot, then a third shot: no return, so both are cuts (issue 44);
    # a min_scene_length the user gives joins the two-frame shot to the third.
    other = shot[:20] + [pattern(2, shift=i) for i in range(2)] + [pattern(8, shift=i)
                                                                  for i in range(18)]
    assert cuts.detect_cuts(other) == _auto_cuts(other) == (20, 22)
    assert _auto_cuts(other, min_scene_length=15) == (20,)
    # A cut-away that returns to the shot it left: a flash up to FLASH_FRAMES long, a shot
    # of its own when longer.
    for length, found in ((cuts.FLASH_FRAMES, ()), (cuts.FLASH_FRAMES + 1, (20, 27))):
        away = shot[:20] + [pattern(2, shift=i) for i in range(length)] + shot[20 + length:]
        assert _auto_cuts(away[:27 + 8]) == found, length


def test_short_shots_are_cut_by_default(tmp_path, capsys):
    """Issue 44: min_scene_length 15 (the old default) cut a clip of 8-frame shots only at 16,
    and a 12-frame image sequence with a cut at 6 not at all: batches mixed two shots."""
    import av

    from seedvr2.cli import main

    shots = [[pattern(seed, shift=i) for i in range(8)] for seed in (1, 2, 3)]
    assert _auto_cuts(sum(shots, [])) == (8, 16)
    assert _auto_cuts(sum(shots, []), min_scene_length=15) == (16,)  # as the user asks
    for i, frame in enumerate(shots[0][:6] + shots[1][:6]):
        av.VideoFrame.from_ndarray(frame, format="rgb24").to_image().save(
            tmp_path / f"{i:03d}.png")
    assert main(["upscale", str(tmp_path / "%03d.png"), "--dry-plan", "--batch-size", "5"]) == 0
    assert "12 frames, 1 scene cut: 6, 4 batches" in capsys.readouterr().out


def test_a_fade_is_no_cut_and_a_fade_into_another_shot_cuts_where_it_appears():
    first, second = ([pattern(seed, shift=i) for i in range(40)] for seed in (1, 2))
    ramp = list(np.linspace(1, 0, 10))
    out = _faded(first[:20], [1] * 10 + ramp)  # frames 10-19 fade to black
    assert _auto_cuts(out + [flat((0, 0, 0))] * 5) == ()
    back = _faded(first[20:], ramp[::-1] + [1] * 10)
    assert _auto_cuts(out + back) == ()  # out to black and back into the same shot
    into = _faded(second, ramp[::-1] + [1] * 10)
    assert _auto_cuts(out + into) == (22,)  # the first frame of the new shot that shows it
    assert _auto_cuts(out + [flat((0, 0, 0))] * 3 + second[:20]) == (23,)  # a hard start


def _features(correlation: float, histogram_distance: float) -> tuple:
    """Two frames' features with the given structure correlation and histogram distance."""
    a, other = np.random.default_rng(0).standard_normal((2, 100))
    other = other - (other @ a) / (a @ a) * a  # orthogonal to a
    unit = lambda v: (v - v.mean()) / v.std()  # noqa: E731
    a = unit(a)
    b = unit(correlation * a + (1 - correlation ** 2) ** 0.5 * unit(other))
    h1, h2 = np.zeros(64), np.zeros(64)
    h1[0], h2[0], h2[1] = 1, 1 - histogram_distance, histogram_distance
    chroma = np.full(3, 1 / 3)
    return cuts.FrameFeatures(a, h1, chroma), cuts.FrameFeatures(b, h2, chroma)


def test_a_cut_needs_both_measures_past_their_thresholds():
    low, high = cuts.MAX_CORRELATION, cuts.MIN_HISTOGRAM_DISTANCE
    assert cuts.is_cut(*_features(low - 0.02, high + 0.02))
    assert not cuts.is_cut(*_features(low + 0.02, high + 0.02))  # same structure: lighting
    assert not cuts.is_cut(*_features(low - 0.02, high - 0.02))  # same colours: motion
    assert not cuts.is_cut(*_features(1.0, 1.0))
    # Two flat frames: only their hue can differ.
    red = np.array([0.6, 0.2, 0.2])
    flat_of = lambda chroma: cuts.FrameFeatures(None, np.zeros(64), chroma)  # noqa: E731
    step = cuts.MIN_FLAT_HUE_DISTANCE / 2
    assert cuts.is_cut(flat_of(red), flat_of(red + [step + 0.01, -step - 0.01, 0]))
    assert not cuts.is_cut(flat_of(red), flat_of(red + [step - 0.01, 0.01 - step, 0]))


# -- the plan ---------------------------------------------------------------------------------

def todays_plan(source_frames: int, opts) -> BatchPlan:
    """The plan before scene cuts existed (the clip as one shot), kept to compare against."""
    prepend = min(opts.prepend_frames, source_frames - 1)
    total, size, overlap = source_frames + prepend, opts.batch_size, opts.temporal_overlap
    batches, start = [], 0
    while True:
        stop = min(start + size, total)
        length = size if opts.uniform_batch_size else next_4n1(stop - start)
        batches.append(Batch(len(batches), start, stop, length, overlap if batches else 0))
        if stop == total:
            break
        start += size - overlap
    chunks, current, fresh = [], [], 0
    for b in batches:
        if current and fresh + b.frames - b.overlap > max(opts.chunk_size, 1):
            chunks.append(tuple(current))
            current, fresh = [], 0
        current.append(b.index)
        fresh += b.frames - b.overlap
    chunks.append(tuple(current))
    return BatchPlan(source_frames, prepend, tuple(batches), tuple(chunks))


def test_without_cuts_the_plan_is_todays():
    for frames, size, overlap, prepend, uniform, chunk in itertools.product(
            (1, 2, 5, 6, 13, 23, 40), (1, 5, 9, 13), (0, 1, 2, 4), (0, 1, 3, 7), (False, True),
            (0, 9, 20)):
        if overlap >= size:
            continue
        opts = resolve_options(batch_size=size, temporal_overlap=overlap, prepend_frames=prepend,
                               uniform_batch_size=uniform, chunk_size=chunk, scene_cuts="off")
        assert make_plan(frames, opts) == todays_plan(frames, opts), (frames, opts.values)


@pytest.mark.parametrize("size,overlap,prepend,uniform", [
    (5, 0, 0, False), (5, 1, 3, False), (9, 4, 20, True), (13, 2, 1, False)])
def test_no_batch_crosses_a_cut(size, overlap, prepend, uniform):
    opts = resolve_options(batch_size=size, temporal_overlap=overlap, prepend_frames=prepend,
                           uniform_batch_size=uniform, chunk_size=10, scene_cuts=CUTS)
    plan = make_plan(26, opts)
    assert plan.prepend == min(prepend, CUTS[0] - 1)  # prepended frames come from shot 1 only
    shots = list(zip((0, *CUTS), (*CUTS, 26)))
    shot_of = lambda frame: next(i for i, (a, b) in enumerate(shots) if a <= frame < b)  # noqa
    for b in plan.batches:
        first, last = plan.source_start(b.start), b.stop - 1 - plan.prepend
        assert shot_of(first) == shot_of(last), b
        starts_shot = first in (0, *CUTS) and b.start >= plan.prepend or b.index == 0
        assert (b.overlap == 0) == (starts_shot or overlap == 0), b
        assert b.length == (size if uniform else next_4n1(b.frames)), b
    # Each shot is planned like a clip of its own length (its last batch padded alike).
    for (a, b) in shots[1:]:
        alone = make_plan(b - a, opts.replace(prepend_frames=0, scene_cuts=()))
        mine = [x for x in plan.batches if a + plan.prepend <= x.start < b + plan.prepend]
        assert [(x.frames, x.length, x.overlap) for x in mine] == \
            [(x.frames, x.length, x.overlap) for x in alone.batches]
    assert sum(plan.chunks, ()) == tuple(range(len(plan.batches)))


def test_option_values_and_errors():
    assert resolve_options().scene_cuts == "auto"
    assert resolve_options(scene_cuts="off").scene_cuts == ()
    assert resolve_options(scene_cuts=" 348, 120 ").scene_cuts == (120, 348)
    assert resolve_options(scene_cuts=[348, 120]).scene_cuts == (120, 348)
    with pytest.raises(OptionError, match=r"^scene_cuts = '7,7': frame 7 is given twice"):
        resolve_options(scene_cuts="7,7")
    with pytest.raises(OptionError, match=r"^scene_cuts = '0,5': a cut is the first frame"):
        resolve_options(scene_cuts="0,5")
    with pytest.raises(OptionError, match=r"expected auto, off, or frame numbers such as 120,348"):
        resolve_options(scene_cuts="soon")
    with pytest.raises(OptionError, match=r"^scene_cuts = '7,30': the input has 26 frames "
                                          r"\(0 to 25\), so a cut at 30 is past its end"):
        cuts.resolve_scene_cuts(resolve_options(scene_cuts="7,30"), 26, lambda: [])
    with pytest.raises(TypeError, match="must be resolved before the batch plan"):
        make_plan(26, resolve_options())
    read = []
    given = cuts.resolve_scene_cuts(resolve_options(scene_cuts="7"), 26, lambda: read.append(1))
    assert given.scene_cuts == (7,) and not read  # given cuts: the frames are not read
    assert cuts.resolve_scene_cuts(resolve_options(), 1, lambda: read.append(1)).scene_cuts == ()
    assert not read  # nor for a single image


# -- upscaling --------------------------------------------------------------------------------

def _upscale(tiny_options, frames, **options):
    import seedvr2

    return seedvr2.upscale(torch.from_numpy(frames), **dict(
        tiny_options, resolution=32, batch_size=5, temporal_overlap=1, prepend_frames=2,
        devices="cpu", min_scene_length=SHORT_SHOTS, **options))


def test_shots_do_not_depend_on_each_other_and_off_is_todays_output(tiny_options):
    from seedvr2.api import load_models
    from seedvr2.pipeline.runner import Upscaler

    clip = cut_clip()
    found = _upscale(tiny_options, clip)  # auto: detects CUTS
    other = _upscale(tiny_options, cut_clip(first_shot=lambda i: pattern(9, shift=-i)))
    assert torch.equal(found[CUTS[0]:], other[CUTS[0]:])
    assert not torch.equal(found[:CUTS[0]], other[:CUTS[0]])
    # off: the plan and frames of before scene cuts existed.
    off = _upscale(tiny_options, clip[:13], scene_cuts="off")
    opts = resolve_options(**{k: v for k, v in tiny_options.items()
                              if k not in ("dit", "vae", "model_dir")}, resolution=32,
                           batch_size=5, temporal_overlap=1, prepend_frames=2, scene_cuts="off")
    models = load_models(tiny_options["dit"], tiny_options["vae"], opts=opts,
                         model_dir=tiny_options["model_dir"])
    todays = torch.cat([out for _, out in Upscaler(models, opts).run(
        iter(torch.from_numpy(clip[:13])), todays_plan(13, opts))])
    assert torch.equal(off, todays)


def test_dry_plan_prints_cuts_and_batches_without_models(tmp_path, capsys):
    from seedvr2.cli import main

    clip = _write_clip(tmp_path / "cuts.mp4")
    assert main(["upscale", str(clip), "--dry-plan", "--batch-size", "5",
                 "--temporal-overlap", "1", "--dit", "missing.safetensors",
                 f"--min-scene-length={SHORT_SHOTS}"]) == 0
    out = capsys.readouterr().out
    assert f"{clip}: 26 frames, 3 scene cuts: 7, 13, 22, 7 batches" in out
    assert "shot from frame 13:\n  batch 4: frames 13-17 (5 frames)\n" \
           "  batch 5: frames 17-21 (5 frames, 1 cross-faded)\nshot from frame 22:\n" \
           "  batch 6: frames 22-25 (4 frames, padded to 5)" in out


def test_prepended_frames_cut_short_by_the_first_shot_are_reported(tmp_path, capsys):
    from seedvr2.cli import main

    clip = _write_clip(tmp_path / "cuts.mp4")
    assert main(["upscale", str(clip), "--dry-plan", "--batch-size", "5", "--prepend-frames",
                 "4", "--scene-cuts", "3,13"]) == 0
    out, err = capsys.readouterr()
    assert err == ("warning: --prepend-frames 4: the first shot has 3 frames (a scene cut at "
                   "frame 3), so 2 are prepended\n")
    assert "  batch 0: frames 0-2 (5 frames, 2 prepended)" in out
    assert main(["upscale", str(clip), "--dry-plan", "--batch-size", "5", "--prepend-frames",
                 "2", "--scene-cuts", "3,13"]) == 0
    assert capsys.readouterr().err == ""  # as many as asked for: nothing to say
    with pytest.warns(UserWarning, match=r"^prepend_frames = 30: the input has 26 frames, so "
                                         r"25 are prepended$"):
        cuts.resolve_scene_cuts(resolve_options(prepend_frames=30, scene_cuts="off"), 26,
                                lambda: iter(()))


# -- files: one process, two ranks, a resumed run ---------------------------------------------

def _write_clip(path):
    import av

    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=FPS)
        video.width, video.height, video.pix_fmt = W, H, "yuv420p"
        video.options = {"crf": "18"}
        for i, frame in enumerate(cut_clip()):
            frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
    return path


def _frames(path):
    from seedvr2.io import open_media

    with open_media(path) as media:
        return np.stack(list(media.frames()))


def _cancelled_after(frames: int) -> dict:
    """progress and should_stop that stop a job once ``frames`` frames are out."""
    done = [0]

    def progress(phase, count, total):
        if phase == "frames":
            done[0] = count
    return dict(progress=progress, should_stop=lambda: done[0] >= frames)


def test_one_process_two_ranks_and_a_resumed_run_give_the_same_file(tiny_options, tmp_path,
                                                                    monkeypatch, caplog, capsys):
    import seedvr2
    from seedvr2.cli import main
    from seedvr2.pipeline.runner import Interrupted, JobStats

    monkeypatch.setenv("SEEDVR2_SEGMENT_FRAMES", "8")  # segments end within the clip
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    clip = _write_clip(tmp_path / "cuts.mp4")
    options = dict(tiny_options, resolution=32, batch_size=5, temporal_overlap=1,
                   min_scene_length=SHORT_SHOTS)
    stats = JobStats()
    one = seedvr2.upscale_file(clip, tmp_path / "one.mp4", stats=stats, **options)
    assert stats.scene_cuts == CUTS
    two = seedvr2.upscale_file(clip, tmp_path / "two.mp4", **{**options, "device": "auto"},
                               devices="cpu,cpu", dist_timeout=30)
    assert np.array_equal(_frames(two), _frames(one))
    # Cancelled with other cuts given, then with auto: the kept segments are not used.
    out = tmp_path / "resumed.mp4"
    with pytest.raises(Interrupted):
        seedvr2.upscale_file(clip, out, scene_cuts="13", **options, **_cancelled_after(20))
    with pytest.raises(Interrupted):
        seedvr2.upscale_file(clip, out, **options, **_cancelled_after(20))
    assert "not resuming, starting fresh: options scene_cuts ([13] -> [7, 13, 22]) changed" \
        in caplog.text
    # The same command again resumes; its summary names the cuts.
    capsys.readouterr()
    assert main(["upscale", str(clip), "-o", str(out), "--dit", tiny_options["dit"], "--vae",
                 tiny_options["vae"], "--model-dir", str(tiny_options["model_dir"]), "--device",
                 "cpu", "--dtype", "fp32", "--resolution", "32", "--batch-size", "5",
                 "--temporal-overlap", "1", f"--min-scene-length={SHORT_SHOTS}"]) == 0
    summary = capsys.readouterr().out
    assert re.search(r"[1-9] of 7 batches reused from a previous run; 3 scene cuts: 7, 13, 22;",
                     summary), summary
    assert out.read_bytes() == one.read_bytes()
