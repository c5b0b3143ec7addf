"""Pause and resume never leave a replica paused: the coordinator against stub replicas on loopback.

A stub answers /pause and /resume as told: 200, an error status for its first few calls, or never (a
stopped process). Real replicas are paused and resumed in tests/integration/test_proxy_failover.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from rl_cluster.proxy.metrics import LatencyHistogram
from rl_cluster.proxy.pausing import PauseCoordinator


@dataclass
class Stub:
    replica_id: str
    refuse: dict[str, int] = field(default_factory=dict)  # op -> how many calls answer 500 first
    hang: bool = False
    calls: list[str] = field(default_factory=list)
    url: str = ""
    released: asyncio.Event = field(default_factory=asyncio.Event)  # set at teardown: hung calls end

    async def handle(self, request: web.Request) -> web.Response:
        op = request.path.strip("/")
        self.calls.append(op)
        if self.hang:
            await self.released.wait()
        if self.refuse.get(op, 0) > 0:
            self.refuse[op] -= 1
            return web.json_response({"error": {"message": f"cannot {op} now"}}, status=500)
        return web.json_response({})


@pytest.fixture
async def stubs():
    made: list[tuple[Stub, web.AppRunner]] = []

    async def make(replica_id: str, **kwargs) -> Stub:
        stub = Stub(replica_id, **kwargs)
        app = web.Application()
        app.router.add_post("/{op}", stub.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stub.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        made.append((stub, runner))
        return stub

    yield make
    for stub, runner in made:
        stub.released.set()
        await runner.cleanup()


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


def coordinator(
    session, replicas: list[Stub], down: dict[str, str], lease_s: float = 60.0
) -> PauseCoordinator:
    def report(replica_id: str, reason: str) -> None:
        down[replica_id] = reason
        replicas[:] = [r for r in replicas if r.replica_id != replica_id]  # out of the reachable set

    c = PauseCoordinator(
        lease_s, lambda: list(replicas), LatencyHistogram(), deadline_s=0.3, retry_s=0.05, down=report
    )
    c.session = session
    return c


async def test_a_hung_replica_is_left_out_of_a_pause_and_reported_down(stubs, session):
    ok, hung = await stubs("g0"), await stubs("g1", hang=True)
    down: dict[str, str] = {}
    c = coordinator(session, [ok, hung], down)
    assert await asyncio.wait_for(c.pause("mode=keep"), 5) == {}
    assert c.paused and ok.calls == ["pause"]
    assert "no answer within load_deadline_s=0.3s" in down["g1"]
    assert await c.resume() == {} and not c.paused
    await c.stop()


async def test_a_refused_resume_is_asked_again_until_confirmed(stubs, session):
    ok, stubborn = await stubs("g0"), await stubs("g1", refuse={"resume": 2})
    c = coordinator(session, [ok, stubborn], {})
    assert await c.pause("mode=keep") == {}
    failures = await c.resume()
    assert list(failures) == ["g1"] and "cannot resume now" in failures["g1"]
    assert c.paused  # g1 may still be paused: the flag says so until it confirms
    for _ in range(100):
        if not c.paused:
            break
        await asyncio.sleep(0.05)
    assert not c.paused and not c.unconfirmed
    assert stubborn.calls == ["pause", "resume", "resume", "resume"]
    await c.stop()


async def test_a_failed_pause_is_rolled_back_and_a_refused_rollback_retried(stubs, session):
    ok = await stubs("g0", refuse={"resume": 1})
    refusing = await stubs("g1", refuse={"pause": 1})
    c = coordinator(session, [ok, refusing], {})
    failures = await c.pause("mode=keep")
    assert list(failures) == ["g1"]
    # g0 paused and refused the rollback once: it is not reported as running until it confirmed.
    assert c.paused and c.unconfirmed == {"g0"}
    for _ in range(100):
        if not c.paused:
            break
        await asyncio.sleep(0.05)
    assert not c.paused and ok.calls == ["pause", "resume", "resume"]
    await c.stop()


async def test_a_replica_joining_after_a_refused_resume_is_resumed_not_paused(stubs, session):
    stubborn = await stubs("g0", refuse={"resume": 100})
    c = coordinator(session, [stubborn], {})
    await c.pause("mode=keep")
    await c.resume()
    assert c.paused and not c.wanted
    joining = await stubs("g1")
    await c.match(joining)
    assert joining.calls == ["resume"]
    await c.stop()


async def test_a_pause_that_waits_for_requests_is_bounded_by_the_lease_and_frees_the_lock(stubs, session):
    """mode=wait waits for a replica's in-flight requests: one that never answers is down after pause_lease_s
    (it had no bound, and held the lock: resume, the lease's expiry and every catch-up waited behind it)."""
    ok, hung = await stubs("g0"), await stubs("g1", hang=True)
    down: dict[str, str] = {}
    c = coordinator(session, [ok, hung], down, lease_s=0.5)
    assert await asyncio.wait_for(c.pause("mode=wait"), 5) == {}
    assert "pause: no answer within pause_lease_s=0.5s" in down["g1"]
    assert await asyncio.wait_for(c.resume(), 5) == {} and not c.paused  # the lock was let go
    assert ok.calls == ["pause", "resume"]
    await c.stop()
