"""The pool's watch of a new replica's first request (rl_cluster.pool.first_request), with a stand-in proxy:
fine at first, coarse later, and bounded (reliability review L6: a replica that never got a request, in a
pool with no clients, was asked about 4 times a second for the rest of the run, one watch per scale-out)."""

from __future__ import annotations

import asyncio

import pytest

from rl_cluster import pool
from rl_cluster.core.scaling import ScaleEvent


class Stats:
    def __init__(self, requests_after: int | None):
        self.asked, self.requests_after = 0, requests_after

    async def _answer(self):
        self.asked += 1
        served = self.requests_after is not None and self.asked > self.requests_after
        return {"replicas": {"g1": {"requests": 1 if served else 0}}}

    def remote(self):
        return self._answer()


class Proxy:
    def __init__(self, requests_after: int | None = None):
        self.stats = Stats(requests_after)


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(pool, "FIRST_REQUEST_POLL_S", 0.001)
    monkeypatch.setattr(pool, "FIRST_REQUEST_FINE_S", 0.05)
    monkeypatch.setattr(pool, "FIRST_REQUEST_COARSE_POLL_S", 0.02)
    monkeypatch.setattr(pool, "FIRST_REQUEST_MAX_S", 0.3)


def test_a_first_request_is_timed(fast):
    event, proxy = ScaleEvent(0.0, 1, 2, "test"), Proxy(requests_after=3)
    asyncio.run(asyncio.wait_for(pool.first_request(proxy, ["g1"], event, decided=0.0), 5))
    assert event.first_request_s is not None and proxy.stats.asked == 4


def test_a_replica_that_never_gets_a_request_is_watched_coarsely_then_no_more(fast):
    event, proxy = ScaleEvent(0.0, 1, 2, "test"), Proxy(requests_after=None)
    asyncio.run(asyncio.wait_for(pool.first_request(proxy, ["g1"], event, decided=0.0), 5))
    assert event.first_request_s is None
    # Fine for 0.05 s (at most 50 asks at 1 ms), then every 20 ms until 0.3 s (at most ~13 more).
    assert proxy.stats.asked < 70, proxy.stats.asked
