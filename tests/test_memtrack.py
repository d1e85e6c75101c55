"""The peak tracker (memtrack.py) against hand-counted bytes, its reach into a round's thread, and the mirror
communicator that lets one process measure what a torch.distributed worker's process holds."""

from __future__ import annotations

import threading

import pytest
import torch

from lordo.comm.base import RoundHandle
from lordo.comm.ledger import Ledger
from lordo.comm.simulated import MirrorCommunicator, SimCommunicator
from lordo.memtrack import PeakTracker, carry


def test_the_peak_is_the_most_held_at_once_counted_by_hand():
    tracker = PeakTracker().begin()
    with tracker.tracking():
        a = torch.empty(1000)  # 4,000 bytes
        b = a * 2  # 8,000 held
        del b  # 4,000
        c = torch.empty(500, dtype=torch.float64)  # 8,000 again, not more
        v = c.view(250, 2)  # a view: the same storage, nothing more
    assert tracker.transient == 8000
    assert tracker.live - tracker.start == 8000
    del a
    assert tracker.live - tracker.start == 4000  # c's storage, kept by its view
    del c
    assert tracker.live - tracker.start == 4000
    del v
    assert tracker.live == tracker.start


def test_what_lived_before_is_followed_until_it_goes_and_exclusions_are_not():
    kept, dropped, excluded = torch.zeros(10_000), torch.zeros(20_000), torch.zeros(40_000)
    key = (str(excluded.device), excluded.untyped_storage().data_ptr())
    tracker = PeakTracker(exclude=[key]).begin()
    start = tracker.live
    del dropped
    assert tracker.live == start - 80_000
    with tracker.tracking():
        x = kept + 1  # 40,000 new
    assert tracker.peak == start  # 40,000 new after 80,000 gone: never above the start
    assert tracker.transient == 0
    del excluded, x


def test_a_round_started_while_tracking_is_tracked_in_its_thread_and_no_other_thread_is():
    def work() -> float:
        u = torch.ones(250_000)  # 1,000,000 bytes
        v = u + 1  # 2,000,000 held
        return float(v[0])

    tracker = PeakTracker().begin()
    with tracker.tracking():
        handle = RoundHandle(Ledger(2, rank=0), work)
        assert handle.wait() == 2.0
    assert tracker.transient == 2_000_000
    untracked = PeakTracker().begin()
    with untracked.tracking():
        thread = threading.Thread(target=work)  # not through carry(): not followed
        thread.start()
        thread.join()
    assert untracked.transient == 0
    assert carry(work) is work  # outside any tracking, carry changes nothing


def _identical(world: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    mine = [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16)]
    return [[t.clone() for t in mine] for _ in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_the_mirror_gives_what_the_simulator_gives_when_every_worker_sends_the_same(world):
    sim, mirror = SimCommunicator(world), MirrorCommunicator(world)
    assert mirror.local_ranks == [0]
    expected, mine = _identical(world), _identical(1)
    sim.all_reduce_mean(expected, "t")
    mirror.all_reduce_mean(mine, "t")
    for a, b in zip(expected[0], mine[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    gathered_sim, gathered = sim.all_gather(_identical(world), "g")[0], mirror.all_gather(_identical(1), "g")[0]
    assert len(gathered) == world
    for row_sim, row in zip(gathered_sim, gathered, strict=True):
        for a, b in zip(row_sim, row, strict=True):
            assert torch.equal(a, b)
    chunks = [torch.arange(4.0) + 10 * j for j in range(world)]  # chunk j goes to worker j
    received = mirror.all_to_all([chunks], "a")[0]
    sim_received = sim.all_to_all([list(chunks) for _ in range(world)], "a")[0]
    assert [c.tolist() for c in received] == [c.tolist() for c in sim_received]
    assert mirror.ledger.total_bytes == sim.ledger.total_bytes > 0
    assert mirror.ledger.total_wire_bytes == sim.ledger.total_wire_bytes


def test_the_bench_counts_a_buffer_a_step_allocates_and_frees(monkeypatch):
    """A hidden transient: an optimizer step that allocates 8 MB and lets it go must raise the row's peak by it."""
    from lordo.bench import memory
    from lordo.optim import LowRankQHAdam

    overrides = ['model.preset="nano"', 'strategy.name="lordo"', "strategy.rank=4"]
    plain = memory.strategy_row(overrides, 256, torch.device("cpu"))
    step = LowRankQHAdam.step

    def wasteful(self, *args, **kwargs):
        scratch = torch.ones(2_000_000)
        scratch.add_(1)
        del scratch
        return step(self, *args, **kwargs)

    monkeypatch.setattr(LowRankQHAdam, "step", wasteful)
    hidden = memory.strategy_row(overrides, 256, torch.device("cpu"))
    assert hidden["measured_bytes"] == plain["measured_bytes"]  # between steps: nothing more held
    assert hidden["peak_bytes"] >= plain["measured_bytes"] + 8_000_000
    assert hidden["transient_bytes"] >= 8_000_000 > plain["transient_bytes"]
