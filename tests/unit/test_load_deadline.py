"""One adapter load has one deadline (proxy.load_timeout_s), below the trainer's client timeout, and a
client whose answer is lost learns the outcome from the proxy.

The proxy side runs the real ReplicaPool over in-memory replicas (loaders that answer, hang or refuse as
told); the client side runs the trainer's ProxyClient against a stub server on loopback.
"""

from __future__ import annotations

import asyncio
import json
import time
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import http_stub
from pydantic import ValidationError

from rl_cluster.config import TRAINER_CONTROL_TIMEOUT_S, ProxyConfig
from rl_cluster.core.deadline import Deadline
from rl_cluster.errors import AdapterRejected, ReplicaDown
from rl_cluster.proxy.adapters import LoadTimedOut
from rl_cluster.proxy.broadcast import LoadFailed, load_everywhere
from rl_cluster.proxy.metrics import LatencyHistogram
from rl_cluster.proxy.replica import Replica
from rl_cluster.proxy.replicas import NoActiveReplica, ReplicaPool
from rl_cluster.trainer.proxy_client import ProxyClient, ProxyControlError

# A broadcast takes at most 2 x 0.1 + 0.1 = 0.3 s, so a load must begin one by 0.6 - 0.3 s.
QUICK = {
    "load_deadline_s": 0.1,
    "health_timeout_s": 0.1,
    "load_timeout_s": 0.6,
    "load_retry_interval_s": 0.02,
}


class Loader:
    def __init__(self, fails_with: Exception | None = None, unload_s: float = 0.0):
        self.fails_with, self.unload_s = fails_with, unload_s
        self.adapters: set[str] = set()

    async def load_adapter(self, name: str, path: str) -> None:
        if self.fails_with is not None:
            raise self.fails_with
        self.adapters.add(name)

    async def unload_adapter(self, name: str) -> None:
        await asyncio.sleep(self.unload_s)
        self.adapters.discard(name)


def pool_of(loaders: dict[str, Loader], **config) -> ReplicaPool:
    pool = ReplicaPool(ProxyConfig(**{**QUICK, **config}), LatencyHistogram())
    for rid, loader in loaders.items():
        pool.replicas[rid] = Replica(rid, "http://127.0.0.1:9", loader, capacity=4)
        pool.book.add_replica(rid)
        pool.book.activate(rid)
    return pool


async def timed(coro, bound_s: float = 5.0):
    """(what `coro` raised, seconds it took); fails when it takes longer than `bound_s` (the old code)."""
    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        await asyncio.wait_for(coro, bound_s)
    return raised.value, time.monotonic() - start


async def test_a_load_stuck_behind_catch_ups_is_answered_by_its_deadline_with_nothing_loaded():
    pool = pool_of({"g0": Loader(), "g1": Loader()})
    async with pool._adapter_lock:  # a catch-up loading versions on a slow replica holds it (minutes)
        error, took = await timed(pool.adapters.load("run-v2", "/bucket/run-v2"))
    assert isinstance(error, LoadTimedOut) and "nothing was loaded" in str(error)
    assert took < 0.6 and not pool.book.known("run-v2")


async def test_waiting_for_a_replica_when_all_were_down_ends_with_the_loads_deadline():
    # The only replica's actor has no server: the load leaves it out, finds every replica down and waits
    # for one, bounded by load_timeout_s, not by unavailable_timeout_s (300 s, the old bound).
    pool = pool_of({"g0": Loader(ReplicaDown("no server"))})
    error, took = await timed(pool.adapters.load("run-v2", "/bucket/run-v2"))
    assert isinstance(error, NoActiveReplica | LoadTimedOut) and took < 0.6


async def test_a_load_whose_replica_left_while_it_waited_for_the_lock_waits_for_one_to_return():
    # The chaos run's phase 3: the load's wait saw g1 active (back from a cut link), a catch-up held the
    # lock, g1 left routing again meanwhile and g0's restarted actor had no server yet. The load found no
    # active replica under the lock and was answered 503 at once; it waits for one within its deadline.
    pool = pool_of({"g0": Loader(), "g1": Loader()}, load_timeout_s=3.0)
    pool.book.mark_unhealthy("g0")
    async with pool._adapter_lock:  # a catch-up
        load = asyncio.create_task(pool.adapters.load("run-v2", "/bucket/run-v2"))
        await asyncio.sleep(0.1)  # the load saw g1 active and waits for the lock
        pool.book.mark_unhealthy("g1")
    await asyncio.sleep(0.2)  # the load found nobody active: it waits (before: its 503 was out by now)
    assert not load.done()
    pool.book.begin_catch_up("g0")  # g0's new server is back, caught up
    pool.book.activate("g0")
    assert await asyncio.wait_for(load, 2.0) == ["g0"]
    assert pool.book.is_routable("run-v2")


async def test_a_load_that_found_no_replica_says_what_it_waited_and_which_setting_ended_it():
    # Its 503 said "active for 300 s (proxy.unavailable_timeout_s)" whatever the load had waited.
    from rl_cluster.proxy.answers import no_active_replica

    pool = pool_of({"g0": Loader()})
    pool.book.mark_unhealthy("g0")
    error, took = await timed(pool.adapters.load("run-v2", "/bucket/run-v2"))
    assert isinstance(error, NoActiveReplica) and error.bound == "proxy.load_timeout_s"
    assert 0.25 < error.waited_s <= took  # it began its broadcast by 0.6 - 0.3 s, or never
    answer = json.loads(no_active_replica(error.waited_s, error.bound).text)
    said = f"no generator replica has been active for {error.waited_s:.0f} s (proxy.load_timeout_s)"
    assert answer["error"]["message"].startswith(said) and error.waited_s < 2


async def test_a_rollback_unloads_everywhere_at_once():
    # Three replicas took the version, one refused it: the three unload in one deadline, not three.
    loaders = {f"g{i}": Loader(unload_s=0.2) for i in range(3)} | {"g3": Loader(AdapterRejected("rank 64"))}
    loaded: list[str] = []
    start = time.monotonic()
    with pytest.raises(LoadFailed):
        await load_everywhere(
            "run-v2", "/bucket/run-v2", loaders, retry_s=0.01, deadline_s=1.0,
            loaded=loaded.append, holders=lambda: list(loaded), unloaded=loaded.remove,
        )  # fmt: skip
    assert time.monotonic() - start < 0.45 and loaded == []


def test_the_deadline_cuts_each_step_to_what_is_left():
    now = [100.0]
    deadline = Deadline.after(10.0, clock=lambda: now[0])
    assert deadline.within(60.0) == 10.0 and deadline.within(3.0) == 3.0
    now[0] = 112.0
    assert deadline.left() == 0.0 and deadline.expired


def test_the_loads_deadline_stays_below_the_trainers_timeout_and_fits_a_broadcast():
    assert ProxyConfig().load_timeout_s < TRAINER_CONTROL_TIMEOUT_S
    with pytest.raises(ValidationError, match="load_timeout_s"):
        ProxyConfig(load_timeout_s=TRAINER_CONTROL_TIMEOUT_S)
    with pytest.raises(ValidationError, match="leaves no time for one load broadcast"):
        ProxyConfig(load_timeout_s=100, load_deadline_s=60)


# -- the client: an answer lost to its timeout -----------------------------------------------------------


class _SlowProxy(BaseHTTPRequestHandler):
    routable: list[str] = []

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(0.5)  # longer than the client waits: the answer is lost
        self.send_response(200)
        self.end_headers()

    def do_GET(self):
        payload = json.dumps({"replicas": {}, "adapters_routable": type(self).routable}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_proxy():
    with http_stub(_SlowProxy) as url:
        yield url


def test_a_client_that_lost_the_answer_to_a_load_asks_whether_it_is_routable(slow_proxy):
    client = ProxyClient(slow_proxy, timeout_s=0.2, reconnect_s=1.0)
    _SlowProxy.routable = ["run-v2"]
    client.load_adapter("run-v2", "/bucket/run-v2")  # loaded: the sync goes on
    _SlowProxy.routable = []
    with pytest.raises(ProxyControlError, match="does not route it"):
        client.load_adapter("run-v3", "/bucket/run-v3")
