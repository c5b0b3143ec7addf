"""A replica a restarted proxy could not reach is registered down, not left out, and comes back by itself.

Real ProxyServers in front of stub vLLM servers on loopback (/health, /v1/models, the adapter routes), so
the health watch, the catch-up and the restore run as in a run. The stub can be down (no answer: its
port refuses) and come up again on the same port, as a vLLM server mid-restart does. The real path,
with Ray and generators, is the pool controller's (rl_cluster.cluster.Cluster.restore_proxy).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from rl_cluster.config import ProxyConfig
from rl_cluster.core.scaling import snapshot
from rl_cluster.proxy.replica import Member
from rl_cluster.proxy.server import ProxyServer

BASE = "tiny-base"
FAST = {"health_interval_s": 0.05, "health_timeout_s": 1.0, "load_deadline_s": 2.0}


class StubVllm:
    """Answers as a vLLM server with runtime LoRA loading does (/health, /v1/models, adapter loads,
    pause and resume); `up()` / `down()` open and close its port."""

    def __init__(self) -> None:
        self.adapters: set[str] = set()
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def up(self) -> StubVllm:
        app = web.Application()
        app.router.add_get("/health", self._ok)
        app.router.add_post("/pause", self._ok)
        app.router.add_post("/resume", self._ok)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/load_lora_adapter", self._load)
        app.router.add_post("/v1/unload_lora_adapter", self._unload)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def down(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _ok(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, _: web.Request) -> web.Response:
        data = [{"id": BASE}] + [{"id": a, "parent": BASE} for a in sorted(self.adapters)]
        return web.json_response({"data": data})

    async def _load(self, request: web.Request) -> web.Response:
        self.adapters.add((await request.json())["lora_name"])
        return web.Response(text="Success")

    async def _unload(self, request: web.Request) -> web.Response:
        self.adapters.discard((await request.json())["lora_name"])
        return web.Response(text="Success")


@pytest.fixture
async def stubs():
    made: list[StubVllm] = []

    async def make() -> StubVllm:
        made.append(await StubVllm().up())
        return made[-1]

    yield make
    for stub in made:
        await stub.down()


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def states(proxy: ProxyServer) -> dict[str, str]:
    return {rid: r["state"] for rid, r in proxy.stats()["replicas"].items()}


async def test_a_replica_mid_restart_at_restore_is_registered_down_and_caught_up_when_it_answers(stubs):
    r0, r1 = await stubs(), await stubs()
    r0.adapters = r1.adapters = {"run-v1"}
    await r1.down()  # its vLLM is mid-restart when the proxy comes back
    proxy = ProxyServer(ProxyConfig(**FAST))
    await proxy.start()
    try:
        held = {"run-v1": "/bucket/run-v1"}
        await proxy.restore({"r0": Member(r0.url, None, 4, held), "r1": Member(r1.url, None, 4, held)})
        # Not skipped: out of routing, and the pool controller counts it as out for now, not as starting.
        assert states(proxy) == {"r0": "active", "r1": "unhealthy"}
        snap, by_state = snapshot(["r0", "r1"], proxy.stats(), 0.0, set(), 0)
        assert by_state["unavailable"] == ["r1"] and by_state["starting"] == []
        await r1.up()  # its server is back, on the same port, empty
        await until(lambda: states(proxy)["r1"] == "active")
        assert "run-v1" in r1.adapters  # caught up before it serves
    finally:
        await proxy.stop()


async def test_a_generator_that_did_not_answer_the_restore_is_asked_again_by_the_health_watch(stubs):
    r0, r1 = await stubs(), await stubs()
    answers: dict[str, Member | None] = {"r1": None}  # what r1's generator says: no server yet

    async def find(replica_id: str) -> Member | None:
        return answers[replica_id]

    proxy = ProxyServer(ProxyConfig(**FAST), find=find)
    await proxy.start()
    try:
        await proxy.restore({"r0": Member(r0.url, None, 4, {})}, unreached={"r1": "TimeoutError: "})
        assert states(proxy) == {"r0": "active", "r1": "unhealthy"}
        assert "did not answer" in proxy.stats()["replicas"]["r1"]["down_reason"]
        await asyncio.sleep(0.2)  # a few health rounds: it still has no server, so it stays down
        assert states(proxy)["r1"] == "unhealthy"
        answers["r1"] = Member(r1.url, None, 4, {})
        await until(lambda: states(proxy)["r1"] == "active")
        assert proxy.stats()["replicas"]["r1"]["url"] == r1.url
    finally:
        await proxy.stop()


async def test_report_back_from_a_replica_the_proxy_does_not_know_registers_it(stubs):
    r0, r1 = await stubs(), await stubs()
    asked: list[str] = []

    async def find(replica_id: str) -> Member | None:
        asked.append(replica_id)
        return Member(r1.url, None, 4, {})

    proxy = ProxyServer(ProxyConfig(**FAST), find=find)
    await proxy.start()
    try:
        await proxy.add_replica("r0", r0.url, capacity=4)
        await proxy.report_back("r1")  # its server restarted; this proxy never had it
        assert asked == ["r1"] and states(proxy) == {"r0": "active", "r1": "active"}
        # One the pool removed stays removed: a late report from it registers nothing.
        await proxy.remove_replica("r1", 0.0)
        await proxy.report_back("r1")
        assert asked == ["r1"] and states(proxy) == {"r0": "active"}
    finally:
        await proxy.stop()
