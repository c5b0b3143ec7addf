"""The trainer's write fence (rl_cluster.core.fence): writes while the run's lease is known held, by the
driver's news, on the writer's own clock."""

import threading

import pytest

from rl_cluster.core.fence import WriteFence
from rl_cluster.errors import LeaseLost


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_writes_are_allowed_until_the_lease_runs_out_less_the_margin():
    clock = Clock()
    fence = WriteFence(margin_s=15, first_news_s=0, clock=clock)
    fence.renewed(60)  # held for 60 s from now: writes until 45 s from now
    clock.now += 44.9
    fence.check("publish v3")
    clock.now += 0.2
    with pytest.raises(
        LeaseLost, match=r"refuses to publish v3: the run's lease was last known held until 0 s ago"
    ):
        fence.check("publish v3")
    fence.renewed(60)  # the driver renewed late, before anyone took it: writes again
    assert fence.refusal() is None


def test_a_lost_lease_refuses_every_write_for_good():
    fence = WriteFence(margin_s=15, first_news_s=0, clock=Clock())
    fence.renewed(60)
    fence.lost("lease.json is now held by host b, pid 7")
    with pytest.raises(LeaseLost, match="driver lost the run's lease .lease.json is now held by host b"):
        fence.check("apply retention")
    fence.renewed(60)  # news from before the loss, arriving late, opens nothing
    assert "lost" in fence.refusal()


def test_a_writer_without_news_waits_for_the_first_then_refuses():
    fence = WriteFence(margin_s=15, first_news_s=0.05, clock=Clock())
    with pytest.raises(LeaseLost, match="no news of the run's lease from the driver within 0 s"):
        fence.check("publish checkpoint 4")
    # A check waiting for its first news writes once the news comes.
    fence = WriteFence(margin_s=15, first_news_s=30, clock=Clock())
    answer: list = []
    waiting = threading.Thread(target=lambda: answer.append(fence.refusal()))
    waiting.start()
    fence.renewed(60)
    waiting.join(5)
    assert answer == [None]


def test_a_fence_passes_on_its_news_without_its_margin():
    """The trainer's coordinator passes the lease's news on to its rank, whose own fence takes the margin:
    taken twice, a 60 s lease would leave the rank 30 s of writes instead of 45."""
    clock = Clock()
    fence = WriteFence(margin_s=15, first_news_s=0, clock=clock)
    assert fence.news() == (None, None)
    fence.renewed(60)
    clock.now += 10
    assert fence.news() == (50.0, None)
    rank = WriteFence(margin_s=15, first_news_s=0, clock=clock)
    rank.renewed(fence.news()[0])
    clock.now += 34.9
    assert rank.refusal() is None  # 44.9 s after the renewal: still inside 60 - 15
    fence.lost("taken over")
    assert fence.news()[1] == "taken over"


def test_a_refused_write_is_handed_on_not_raised():
    """`admits`: the trainer's way to ask mid-step; a refusal goes to on_refused (which stops training at
    the step's end on every rank) rather than raising out of the step."""
    clock, refused = Clock(), []
    fence = WriteFence(margin_s=15, first_news_s=0, clock=clock, on_refused=refused.append)
    fence.renewed(60)
    assert fence.admits("publish v3") and refused == []
    clock.now += 45.1
    assert not fence.admits("publish v4")
    assert refused == [
        "the trainer refuses to publish v4: the run's lease was last known held until 0 s ago (less a 15 s "
        "margin): the driver stopped renewing it (frozen, or cut off from the bucket), and another driver may "
        "hold it now. The run that holds the lease writes this run"
    ]
