"""Several processes when things go wrong: a killed writer rank, a frozen rank (taken over),
a slow rank, different weights on one rank, impossible sequence parallelism; stale
temporaries of killed runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import netns
from conftest import REPO, make_clip

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "clip.mp4"
    make_clip(path, frames=23)  # six batches of 5 overlapping by 1
    return path


def _frames(folder):
    from seedvr2.io import open_media

    with open_media(f"{folder}/%05d.png") as media:
        return np.stack(list(media.frames()))


def _cli(tiny_options, src, dst, *extra, env=None, timeout=300, quiet=True):
    cmd = [sys.executable, "-m", "seedvr2", "upscale", str(src), "-o", str(dst),
           *(["--quiet"] if quiet else []),
           "--dit", tiny_options["dit"], "--vae", tiny_options["vae"],
           "--model-dir", str(tiny_options["model_dir"]), "--dtype", "fp32",
           "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
           "--resolution", "32", "--batch-size", "5", "--temporal-overlap", "1", *extra]
    environment = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=environment,
                          timeout=timeout)


def test_killed_writer_rank_leaves_no_temporary(clip, tiny_options, tmp_path):
    """Rank 0 dies after writing a batch: the launcher removes the temporary it left."""
    out = tmp_path / "out"
    out.mkdir()
    result = _cli(tiny_options, clip, out / "up.mp4", "--devices", "cpu,cpu", "--dist-timeout",
                  "10", env={"SEEDVR2_FAULT": "0:after_batches=1"})
    assert result.returncode != 0
    assert "rank 0" in result.stderr, result.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == []


_WRITE_AND_DIE = """
import os, signal, sys
import numpy as np
from seedvr2.io import OutputSpec, open_writer
writer = open_writer(sys.argv[1], OutputSpec(width=32, height=32, channels=3, bit_depth=8, fps=25))
writer.write(np.zeros((32, 32, 3), np.uint8))
print("written", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("name", ["up.mp4", "up.png", "frames/"])
def test_next_run_removes_temporaries_of_a_killed_one(tmp_path, name):
    """Under torchrun no launcher of ours survives a killed rank 0; the next writer of the same
    output removes what it left, and never a temporary that a live writer holds."""
    from seedvr2.io import OutputSpec, open_writer
    from seedvr2.io.temporaries import temporaries_of

    dst = f"{tmp_path}/{name}"  # a trailing "/" (a frame folder) must stay
    killed = subprocess.run([sys.executable, "-c", _WRITE_AND_DIE, dst], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL and "written" in killed.stdout, killed.stderr
    stale = temporaries_of(dst)
    assert len(stale) == 1 and stale[0].name.startswith(".up" if name != "frames/" else ".frames")

    spec = OutputSpec(width=32, height=32, channels=3, bit_depth=8, fps=25)
    live = open_writer(dst, spec)
    assert not stale[0].exists()  # the killed run's temporary is gone
    assert temporaries_of(dst) == [live._temp]
    second = open_writer(dst, spec)
    assert live._temp.exists()  # held by a live writer: left alone
    second.abort()
    live.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_digest_compares_model_and_input_content(tiny_model_dir, tmp_path, clip):
    """A copy of the DiT with one bias changed (same name, same size) and an input with the
    same size and frame count but other pixels are both told apart."""
    import torch
    from safetensors.torch import load_file, save_file

    from seedvr2.options import resolve_options
    from seedvr2.pipeline.identity import ModelRef, identity_digest, job_identity

    def job_digest(opts, dit, vae, source):
        return identity_digest(job_identity(opts, source, (ModelRef("dit", dit),
                                                           ModelRef("vae", vae))))

    original = tiny_model_dir / "dit3b_tiny.safetensors"
    weights = load_file(original)
    key = next(k for k in weights if k.endswith(".bias"))
    weights[key] = weights[key].clone()
    weights[key][0] += 1
    from safetensors import safe_open
    with safe_open(original, "pt") as f:
        metadata = f.metadata()
    (tmp_path / "other").mkdir()
    changed = tmp_path / "other" / original.name
    save_file(weights, changed, metadata=metadata)
    assert changed.stat().st_size == original.stat().st_size
    vae = tiny_model_dir / "vae_tiny.safetensors"
    opts = resolve_options(batch_size=5)
    same = job_digest(opts, original, vae, source="a")
    assert job_digest(opts, original, vae, source="a") == same
    assert job_digest(opts, changed, vae, source="a") != same

    from seedvr2.io import open_media
    from seedvr2.pipeline.identity import source_digest
    other_clip = tmp_path / "clip.mp4"
    make_clip(other_clip, frames=23)
    with open(other_clip, "r+b") as f:  # same size, other content
        f.seek(-200, os.SEEK_END)
        f.write(bytes(200))
    with open_media(clip) as a, open_media(other_clip) as b:
        assert a.info.frame_count == b.info.frame_count
        assert source_digest(a) != source_digest(b)
    del torch


@pytest.fixture(scope="module")
def single(clip, tiny_options, tmp_path_factory):
    """The frames of one process: what every multi-process run must give."""
    out = tmp_path_factory.mktemp("one")
    result = _cli(tiny_options, clip, f"{out}/", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    return _frames(out)


@pytest.mark.parametrize("after", [1, 99])
def test_frozen_rank_is_stopped_and_taken_over_within_dist_timeout(clip, tiny_options, tmp_path,
                                                                   single, after):
    """Rank 1 freezes (SIGSTOP, as a hung driver would). After its first batch, with the
    second batch of its chunk still to deliver: the writer kills it after dist_timeout and
    computes that batch itself. After its last batch (99 > its share): the output is complete
    and the launcher stops it. Either way the job ends within dist_timeout of the freeze plus
    a few seconds (plus the chunks the writer computes meanwhile), with the frames of one
    process."""
    mark = tmp_path / "froze-at"
    result = _cli(tiny_options, clip, f"{tmp_path}/out/", "--devices", "cpu,cpu",
                  "--dist-timeout", "5", "--chunk-size", "9",  # chunks [0, 1], [2, 3], [4, 5]
                  env={"SEEDVR2_FAULT": f"1:freeze_after_batches={after}",
                       "SEEDVR2_FAULT_MARK": str(mark)}, quiet=False)
    ended = time.time()
    froze = float(mark.read_text())
    assert ended - froze < 5 + 20, f"ended {ended - froze:.1f}s after the freeze"
    assert result.returncode == 0, result.stderr[-3000:]
    if after == 1:
        assert ("rank 1 has shown no sign of life for dist_timeout (5s): frozen, hung or cut "
                "off: rank 0 computed its 1 unfinished batch(es) itself") in result.stderr, \
            result.stderr[-3000:]
        assert "the job finished without rank(s) 1" in result.stderr
        assert "without rank 1 (killed by signal 9) from then on" in result.stdout, result.stdout
    assert np.array_equal(_frames(tmp_path / "out"), single)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["froze-at", "out"]


@pytest.mark.parametrize("after", [1, 99])
def test_frozen_writer_is_stopped_within_dist_timeout(clip, tiny_options, tmp_path, after):
    """The writer freezes (SIGSTOP). After its first batch: rank 1, waiting for it, gives up
    after dist_timeout, and the launcher, seeing that the writer's sign of life has stopped,
    kills it and fails the job naming it; its temporary is removed. After its output is
    complete (99 > the batches; as a writer stuck leaving an NCCL group would be): the job
    succeeds, and the launcher stops the writer. Either way within dist_timeout of the freeze
    plus a few seconds."""
    mark = tmp_path / "froze-at"
    out = tmp_path / "out"
    out.mkdir()
    result = _cli(tiny_options, clip, out / "up.mp4", "--devices", "cpu,cpu", "--dist-timeout",
                  "5", "--chunk-size", "9",
                  env={"SEEDVR2_FAULT": f"0:freeze_after_batches={after}",
                       "SEEDVR2_FAULT_MARK": str(mark)})
    ended = time.time()
    assert ended - float(mark.read_text()) < 5 + 20
    if after == 1:
        assert result.returncode != 0
        assert ("rank 0 (the writer) has shown no sign of life for dist_timeout (5s)"
                in result.stderr), result.stderr[-2000:]
        assert sorted(p.name for p in out.iterdir()) == []
    else:
        assert result.returncode == 0, result.stderr[-2000:]
        assert "rank(s) [0] did not exit within dist_timeout (5s)" in result.stderr
        assert sorted(p.name for p in out.iterdir()) == ["up.mp4"]


def test_slow_rank_takes_fewer_chunks(clip, tiny_options, tmp_path, single):
    """Chunks are taken, not dealt: a rank slowed on purpose (4 s per batch) takes fewer of
    the six chunks than the writer, and the frames are those of one process."""
    result = _cli(tiny_options, clip, f"{tmp_path}/two/", "--devices", "cpu,cpu",
                  "--dist-timeout", "60", env={"SEEDVR2_SLOW": "1:4"}, quiet=False)
    assert result.returncode == 0, result.stderr[-2000:]
    import re
    taken = dict(re.findall(r"rank (\d+): (\d+)", result.stderr.split("chunks taken:")[-1]))
    assert int(taken.get("1", 0)) < 3 < int(taken["0"]), result.stderr[-2000:]
    assert np.array_equal(_frames(f"{tmp_path}/two"), single)


@pytest.mark.parametrize("devices,k,message", [
    ("cpu,cpu,cpu", 2, r"sequence_parallel = 2 must divide the number of ranks \(3\)"),
    ("cpu,cpu,cpu", 3, r"this DiT has 2 heads"),
])
def test_impossible_sequence_parallel_is_refused_before_any_worker(
        clip, tiny_options, tmp_path, monkeypatch, devices, k, message):
    import seedvr2
    from seedvr2.distributed import launch
    from seedvr2.options import OptionError

    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started")
    monkeypatch.setattr(launch, "_launched", no_workers)
    with pytest.raises(OptionError, match=message):
        seedvr2.upscale_file(clip, tmp_path / "out.mp4", **tiny_options, devices=devices,
                             sequence_parallel=k, batch_size=5)
    frames = np.zeros((5, 16, 16, 3), np.float32)
    import torch
    with pytest.raises(OptionError, match=message):
        seedvr2.upscale(torch.from_numpy(frames), **tiny_options, devices=devices,
                        sequence_parallel=k, batch_size=5)
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == []


# A rank cut off ends within dist_timeout of the cut plus this: its lifeline looks every
# quarter second (its last answer came before the cut), plus the thread's wake-up on a loaded
# machine. Its node's torchrun then notices and ends: measured 1-6 s more on a 2-core machine
# under load, hence its own slack.
RANK_SLACK_S, NODE_SLACK_S = 2.0, 15.0
LOST = "rank 1 lost the job: the job's store (10.213.0.1:29500) has not answered for dist_timeout"


def _torchrun_node(tiny_options, clip, out, node: int, timeout: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
            netns.ADDRESSES[0], "--master-port", "29500", "--rdzv-conf", "timeout=60",
            "-m", "seedvr2", "upscale", str(clip), "-o", f"{out}/", "--dit", tiny_options["dit"],
            "--vae", tiny_options["vae"], "--model-dir", str(tiny_options["model_dir"]),
            "--dtype", "fp32", "--device", "cpu",
            "--text-embeddings", str(tiny_options["model_dir"] / "text_64.safetensors"),
            "--resolution", "32", "--batch-size", "5", "--temporal-overlap", "1",
            "--chunk-size", "9", "--dist-timeout", str(timeout)]


def _wait_for(condition, seconds: float) -> float | None:
    """Seconds until ``condition()`` (polled), or None when it is not so within ``seconds``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > seconds:
            return None
        time.sleep(0.02)
    return time.monotonic() - start


def test_two_nodes_leave_nothing_behind_when_a_test_fails():
    """The namespaced nodes' cleanup: a test failing right after starting a command on each
    node (before unshare could tie its child's life to its own) leaves no process in the
    namespaces, and the namespaces go with them."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"two nodes in namespaces of their own: {reason}")
    with pytest.raises(RuntimeError, match="the test failed"):
        with netns.TwoNodes() as nodes:
            started = [nodes.start(node, ["sleep", "60"]) for node in (0, 1)]
            raise RuntimeError("the test failed")
    assert nodes._inside() == []
    assert all(p.poll() is not None for p in started + nodes.holders)


def test_node_cut_off_mid_job_ends_itself_and_the_writer_finishes(clip, tiny_options, tmp_path,
                                                                  single):
    """Two machines as a cluster has them: torchrun on each node (static rendezvous, gloo, one
    rank per node), each in network and PID namespaces of its own, so the writer can neither
    see nor signal rank 1. Once rank 1 has delivered its first batch, its node's link is cut:
    no reset, no error, silence. Rank 1 ends itself within dist_timeout plus RANK_SLACK_S of
    the cut, saying what it lost, whatever it was blocked in (before: still running when the
    test gave up), and its node's torchrun fails within NODE_SLACK_S more; the writer takes
    its batches over and writes the frames of one process."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"two nodes in namespaces of their own: {reason}")
    timeout, mark, out = 4, tmp_path / "cut-at", tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", SEEDVR2_FAULT="1:cut_off_after_batches=1",
               SEEDVR2_FAULT_MARK=str(mark))
    logs = [tmp_path / f"node{node}.err" for node in (0, 1)]
    with netns.TwoNodes() as nodes:
        runs = []
        for node, log in enumerate(logs):
            with open(log, "w") as err:
                runs.append(nodes.start(node, _torchrun_node(tiny_options, clip, out, node,
                                                             timeout),
                                        cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                        env=dict(env, GLOO_SOCKET_IFNAME=netns.INTERFACES[node])))
        _wait_for(lambda: mark.exists() or any(r.poll() is not None for r in runs), 120)
        assert mark.exists(), logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
        nodes.cut(1)
        Path(f"{mark}.cut").touch()  # rank 1 carries on
        rank = _wait_for(lambda: LOST in logs[1].read_text(), timeout + RANK_SLACK_S)
        node = _wait_for(lambda: runs[1].poll() is not None, timeout + NODE_SLACK_S)
        print(f"cut off with dist_timeout {timeout}s, rank 1 ended "
              f"{'%.1fs' % rank if rank is not None else 'not'} after the cut, its torchrun "
              f"{'%.1fs later' % node if node is not None else 'not'} (status "
              f"{runs[1].returncode})")
        assert rank is not None, f"rank 1 still runs {timeout + RANK_SLACK_S}s after the " \
                                 f"cut: " + logs[1].read_text()[-3000:]
        assert node is not None and runs[1].returncode != 0
        assert _wait_for(out.is_dir, 120) is not None, logs[0].read_text()[-3000:]
    assert "rank 1 has shown no sign of life for dist_timeout" in logs[0].read_text(), \
        logs[0].read_text()[-3000:]
    assert np.array_equal(_frames(out), single)
