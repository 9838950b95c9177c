"""Sequence parallelism (Ulysses all-to-all) over gloo CPU ranks: the same output as one process."""

from __future__ import annotations

import datetime
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from seedvr2.distributed.sequence import ShardedPacking, shard_bounds
from seedvr2.models.packing import Packing

from conftest import constructor_kwargs, conformance_dir, dit_bound, dit_output, load_case

CASES = ["taps_video_small", "image", "video_ragged", "batch2_mixed", "batch2_multiwindow_first"]


def test_shard_bounds_cover_rows_unevenly():
    assert shard_bounds(7, 3) == [0, 3, 5, 7]
    assert shard_bounds(1, 2) == [0, 1, 1]
    assert shard_bounds(6, 2) == [0, 3, 6]


def test_sharded_packing_gives_own_rows_of_per_token_values():
    packing = Packing([(1, 2, 3), (2, 2, 2), (1, 1, 1)], [2, 3, 1], torch.device("cpu"))
    values = torch.arange(3.0)[:, None] * torch.ones(1, 4)
    full = packing.per_token(values, "vid")
    for start, end in [(0, 5), (5, 11), (11, 15), (6, 6)]:
        sharded = ShardedPacking(packing.patched_thw, packing.txt_lens, packing.device,
                                 rows=(start, end))
        assert torch.equal(sharded.per_token(values, "vid"), full[start:end])
        assert torch.equal(sharded.per_token(values, "txt"), packing.per_token(values, "txt"))


def test_first_call_at_each_shape_meets_before_every_exchange(monkeypatch, conformance):
    """Ranks reach the first exchange after loading, encoding and compiling at their own
    speeds: during the first call at each shape every exchange (NCCL, the job's timeout)
    comes after a meeting (polled in the store, watching the peers live); later calls
    exchange directly."""
    import torch.distributed as dist

    from seedvr2.distributed.sequence import sequence_parallel
    from seedvr2.loading import load_dit

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    class Meeting:
        def meet(self):
            calls.append(("meet", "store"))

    def exchange(out, send, output_split_sizes=None, input_split_sizes=None, group=None):
        calls.append(("exchange", group))
        out.zero_()  # the peer's rows: any values of the right shape
    monkeypatch.setattr(dist, "all_to_all_single", exchange)
    folder = conformance / "dit3b_tiny"
    model = load_dit(folder / "weights.safetensors")
    exchanges = 2 * len(model.blocks) + 1
    first_shape = [("meet", "store"), ("exchange", "nccl")] * exchanges
    again = [("exchange", "nccl")] * exchanges
    with sequence_parallel(model, group="nccl", meeting=Meeting()), torch.no_grad():
        for name, expected in [("image", first_shape), ("image", again),
                               ("video_ragged", first_shape), ("image", again)]:
            calls.clear()
            model(*_inputs(load_case(folder, name)))
            assert calls == expected, name
    with sequence_parallel(model, group="nccl"), torch.no_grad():  # no meeting group: none
        calls.clear()
        model(*_inputs(load_case(folder, "image")))
        assert calls == [("exchange", "nccl")] * exchanges


def _inputs(case: dict) -> tuple:
    return tuple(case[f"inputs.{k}"] for k in ("vid", "txt", "vid_shape", "txt_shape", "timestep"))


def _one_token_case(generator) -> dict:
    """One video token: with two ranks, one of them holds no rows at all."""
    return {"inputs.vid": torch.randn(4, 33, generator=generator),
            "inputs.txt": torch.randn(3, 64, generator=generator),
            "inputs.vid_shape": torch.tensor([[1, 2, 2]]), "inputs.txt_shape": torch.tensor([[3]]),
            "inputs.timestep": torch.tensor([1000.0])}


def _six_head_dit(family: str):
    """A tiny DiT with 6 heads (3 ranks x 2 heads), random weights identical on every rank."""
    from seedvr2.models import build_dit

    kwargs = dict(constructor_kwargs(conformance_dir() / family), heads=6, head_dim=32)
    if "rope_dim" in kwargs:
        kwargs["rope_dim"] = 30
    torch.manual_seed(0)
    model = build_dit(kwargs)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.eval()


# How long a rank waits for a peer before gloo gives up. The ranks share the machine's cores
# (3 ranks on 2 cores in CI, beside the pytest process), and before the first exchange each
# rank imports torch and computes its own single-process reference: a peer can lag by tens of
# seconds there, so 10 s (as before) was tight. A real hang still ends the test in 2 minutes.
PEER_TIMEOUT = datetime.timedelta(seconds=120)


def _worker(rank: int, world: int, out_dir: str):
    import torch.distributed as dist

    from seedvr2.distributed.sequence import sequence_group, sequence_parallel
    from seedvr2.loading import load_dit

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # Rendezvous through a file in the test's own folder: a port picked free beforehand can be
    # taken by another process (a leftover worker of an earlier test) before rank 0 binds it.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world, timeout=PEER_TIMEOUT)
    results = {}
    try:
        root = conformance_dir()
        if world == 2:  # groups of consecutive ranks; a group of one runs the plain forward
            assert sequence_group(2) is None
            with pytest.raises(ValueError, match="must divide"):
                sequence_group(3)
            alone = sequence_group(1)
            assert dist.get_world_size(alone) == 1
            with sequence_parallel(load_dit(root / "dit3b_tiny" / "weights.safetensors"),
                                   alone) as strategy:
                assert strategy is None
        for family in ("dit3b_tiny", "dit7b_tiny"):
            if world == 2:
                model = load_dit(root / family / "weights.safetensors")
                cases = {name: load_case(root / family, name) for name in CASES}
                cases["one_token"] = _one_token_case(torch.Generator().manual_seed(2))
            else:
                # The tiny models' 2 heads do not split over 3 ranks: a clear error, no hang.
                with pytest.raises(ValueError, match="divisible by 3"):
                    with sequence_parallel(load_dit(root / family / "weights.safetensors")):
                        pass
                model = _six_head_dit(family)
                cases = {name: load_case(root / family, name)
                         for name in ("taps_video_small", "batch2_multiwindow_first")}
            for name, case in cases.items():
                reference = dit_output(model, case)
                seen = []  # proof that it really ran sharded: rows per block, exchanges
                hook = model.blocks[0].register_forward_pre_hook(
                    lambda m, args: seen.append(args[0].shape[0]))
                exchange = dist.all_to_all_single
                dist.all_to_all_single = lambda *a, **k: (seen.append("a2a"), exchange(*a, **k))[1]
                try:
                    with torch.no_grad(), sequence_parallel(model):  # the whole world's group
                        out = model(*_inputs(case))
                finally:
                    dist.all_to_all_single = exchange
                    hook.remove()
                tokens = case["inputs.vid"].shape[0] // 4
                assert seen[0] == shard_bounds(tokens, world)[rank + 1] - shard_bounds(tokens, world)[rank]
                assert seen.count("a2a") == 2 * len(model.blocks) + 1
                assert model.sequence_parallel is None
                assert all(b.attn.sequence_parallel is None for b in model.blocks)
                # Sharded attention sums the same terms in another order: conftest.dit_bound.
                results[f"{family}/{name}"] = ((out - reference).abs().max().item(),
                                               dit_bound(model, case, reference))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()  # no rank closes its connections while a peer still exchanges
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.left").touch()


def _spawn(world: int, out_dir: Path):
    """Runs the ranks. A rank killed by a signal after it wrote its results and passed the final
    barrier, but before it left the process group, crashed inside gloo's teardown (seen once in
    CI: "terminate called without an active exception", SIGABRT; gloo's issue 155 describes
    the race). That is torch's, not what this test checks: warned about, not failed. Any other
    failure is raised."""
    try:
        mp.spawn(_worker, args=(world, str(out_dir)), nprocs=world, join=True)
    except mp.ProcessExitedException as failure:
        rank = failure.error_index
        written = all((out_dir / f"rank{r}.json").exists() for r in range(world))
        if failure.signal_name is None or not written or (out_dir / f"rank{rank}.left").exists():
            raise
        warnings.warn(f"rank {rank} ended by {failure.signal_name} while leaving the process "
                      f"group, after every rank had finished: gloo teardown crash")


@pytest.mark.parametrize("world", [2, 3])
def test_matches_single_process_forward(world, tmp_path, conformance):
    _spawn(world, tmp_path)
    for rank in range(world):
        diffs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(diffs) == (12 if world == 2 else 4)
        over = {name: (diff, bound) for name, (diff, bound) in diffs.items() if diff > bound}
        assert not over, (rank, over)
