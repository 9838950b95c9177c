"""Who is still in the job, in one process against in-memory stores: a rank whose store stops
answering (silent, or failing) ends itself within dist_timeout and says what it lost, one
that answers slowly does not; a meeting of a sequence group waits for its ranks and fails on a
lost one instead of waiting. The end to end case (a node cut off its network, other PID
namespace): test_faults.py::test_node_cut_off_mid_job_ends_itself_and_the_writer_finishes."""

from __future__ import annotations

import threading
import time

import pytest

from seedvr2.distributed import peers, sequence
from test_taking import MemoryStore, _dead_pid

TIMEOUT_S = 0.4  # the job's dist_timeout here; the lifeline beats and looks 10 times as often


class SilentStore(MemoryStore):
    """A store on the other side of a cut cable: a call never returns (until released)."""

    def __init__(self):
        super().__init__()
        self.released = threading.Event()

    def add(self, key, amount):
        self.released.wait(30)
        raise ConnectionError("released")


class FailingStore(MemoryStore):
    """A store whose host is gone: every call fails at once."""

    def add(self, key, amount):
        raise ConnectionResetError("Connection reset by peer")


class SlowStore(MemoryStore):
    """A store that answers, each time well within dist_timeout."""

    def add(self, key, amount):
        time.sleep(TIMEOUT_S / 2)
        return super().add(key, amount)


@pytest.fixture
def ended(monkeypatch):
    """``os._exit`` as the lifeline calls it, recorded (with when) instead of ending pytest."""
    calls = []
    monkeypatch.setattr(peers.Lifeline, "PERIOD_S", TIMEOUT_S / 10)
    monkeypatch.setattr(peers.os, "_exit", lambda code: calls.append((code, time.monotonic())))
    return calls


def _live(store, seconds: float, ended: list) -> float:
    """Run rank 1's lifeline on ``store`` for ``seconds`` or until it ends the rank; returns
    when it started."""
    started = time.monotonic()
    with peers.Lifeline(peers.JobKeys(store), 1, TIMEOUT_S):
        while not ended and time.monotonic() - started < seconds:
            time.sleep(0.01)
    return started


@pytest.mark.parametrize("store,last", [(SilentStore(), "last: no answer"),
                                        (FailingStore(), "last: Connection reset by peer")],
                         ids=["silent", "failing"])
def test_a_rank_whose_store_stops_answering_ends_itself(ended, caplog, store, last):
    """Cut off (the store never answers: no error, ever) or with the store's host gone (every
    call fails): the rank ends with CUT_OFF_EXIT_CODE within dist_timeout and a look, naming
    the store, the time and the last trouble. The old heartbeat returned quietly instead."""
    with caplog.at_level("ERROR", logger="seedvr2"):
        started = _live(store, 3 * TIMEOUT_S, ended)
    if isinstance(store, SilentStore):
        store.released.set()
    assert ended, "the lifeline did not end the rank"
    code, when = ended[0]
    assert code == peers.CUT_OFF_EXIT_CODE == 3
    # Within dist_timeout and a look (a quarter period), plus the thread's scheduling on a
    # loaded machine: the old heartbeat never ended the rank at all.
    assert TIMEOUT_S < when - started < TIMEOUT_S + 1.0
    assert (f"rank 1 lost the job: the job's store ({type(store).__name__}) has not answered for "
            f"dist_timeout ({TIMEOUT_S:g}s; {last}): this node is cut off from the job, or its "
            f"host is gone; ending this rank (exit code 3)") in caplog.text


def test_a_slow_store_is_not_a_lost_job(ended):
    """A store that answers within dist_timeout each time (a loaded machine) keeps the rank
    in the job; the beats reach it."""
    store = SlowStore()
    _live(store, 3 * TIMEOUT_S, ended)
    assert ended == []
    assert int(store.values[next(k for k in store.values if k.endswith("alive/1"))]) >= 2


def _meeting(store):
    keys = peers.JobKeys(store)
    return sequence.Meeting(None, [0, 1], 0, keys, peers.Liveness(keys, TIMEOUT_S))


def test_a_meeting_waits_for_its_ranks_and_fails_on_a_lost_one():
    """Rank 0 meets rank 1, which arrives well after dist_timeout (compiling, say) but beats
    meanwhile: the meeting waits for it (a collective with dist_timeout would have failed).
    Then it meets again with rank 1 gone: that raises RankLost naming it instead of
    waiting."""
    store = MemoryStore()
    meeting = _meeting(store)
    keys, late = meeting.keys, 2.5 * TIMEOUT_S

    def slow_peer():  # beats, then arrives
        start = time.monotonic()
        while time.monotonic() - start < late:
            store.add(keys.key("alive/1"), 1)
            time.sleep(TIMEOUT_S / 4)
        store.add(keys.key("meeting/0/1"), 1)
    peer = threading.Thread(target=slow_peer)
    peer.start()
    started = time.monotonic()
    meeting.meet()
    assert late <= time.monotonic() - started < late + 2
    peer.join()
    store.set(keys.key("where/1"), peers.where(_dead_pid()))
    with pytest.raises(peers.RankLost, match="rank 1 exited"):
        meeting.meet()


def test_every_group_of_a_job_has_its_dist_timeout(monkeypatch):
    """The groups one rank of a sequence-parallel job makes (its sequence group, the meeting
    group the latents travel over, the frame group; every rank makes each group of the world)
    all have the job's dist_timeout: no two-hour frame group, no one-hour meeting group."""
    import datetime

    import torch

    from seedvr2.distributed import rank_work as job
    from seedvr2.distributed.groups import DistContext
    from seedvr2.options import resolve_options

    made = []
    monkeypatch.setattr(sequence.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(sequence.dist, "get_rank", lambda group=None: 3)
    # a gloo world: NCCL groups wait longer than any forward (test_distributed checks that)
    monkeypatch.setattr(sequence.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(sequence.dist, "new_group",
                        lambda ranks=None, **kwargs: made.append((ranks, kwargs)) or len(made))
    monkeypatch.setattr(peers.dist.distributed_c10d, "_get_default_store", MemoryStore)
    opts = resolve_options(sequence_parallel=2, dist_timeout=7)
    links = job.Links.make(DistContext(3, 4, 3, torch.device("cpu")), opts)
    assert [ranks for ranks, _ in made] == [[0, 1], [2, 3], [0, 1], [2, 3], None]
    assert {kwargs["timeout"] for _, kwargs in made} == {datetime.timedelta(seconds=7)}
    assert (links.sequence_group, links.meeting.group, links.frames_group) == (2, 4, 5)
    assert (links.meeting.ranks, links.meeting.rank) == ([2, 3], 3)
