"""Replica health and failover, against real vLLM CPU servers.

A replica that fails its health check leaves routing at once and comes back through catch-up (loading
what it missed); a generation whose replica dies before the client got a byte is retried on another one;
a stream that had already started ends with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import aiohttp
import pytest
from aiohttp import web
from conftest import free_port
from test_proxy import adapter_dir, post_json, replica_models, unique, wait_until  # noqa: F401

from rl_cluster.config import ProxyConfig
from rl_cluster.generator.server import ServerSpec, VLLMServer
from rl_cluster.proxy.adapter_loader import HttpAdapterLoader
from rl_cluster.proxy.forward import REPLICA_HEADER
from rl_cluster.proxy.server import ProxyServer

pytestmark = pytest.mark.vllm


class PlayDead:
    """A pass-through in front of a real vLLM server that can play dead: 503 on every route."""

    def __init__(self, target: str):
        self.target = target
        self.down = False
        self.hang_ups = 0  # generations to hang up on once received, without a word (a broken connection)
        self.generations = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _handle(self, request: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"error": "engine dead"}, status=503)
        if request.path.endswith("completions"):
            self.generations += 1
            if self.hang_ups:
                self.hang_ups -= 1
                await request.read()
                request.transport.close()
                return web.Response()  # never sent: the connection is gone
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with self._session.request(
            request.method, self.target + request.path_qs, data=await request.read(), headers=headers
        ) as upstream:
            content_type = upstream.headers.get("Content-Type", "application/json")
            return web.Response(status=upstream.status, body=await upstream.read(), content_type=None,
                                headers={"Content-Type": content_type})  # fmt: skip

    async def stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()


@contextlib.asynccontextmanager
async def proxy_over(replicas: dict[str, str], **config):
    proxy = ProxyServer(ProxyConfig(**config))
    url = await proxy.start()
    try:
        for replica_id, replica_url in replicas.items():
            await proxy.add_replica(replica_id, replica_url)
        yield proxy, url
    finally:
        for replica in proxy.stats()["replicas"].values():
            for name in replica["adapters_loaded"]:
                with contextlib.suppress(Exception):
                    await HttpAdapterLoader(replica["url"]).unload_adapter(name)
        await proxy.stop()


async def test_unhealthy_replica_leaves_routing_and_catches_up(vllm_servers, adapter_dir):  # noqa: F811
    front = PlayDead(vllm_servers[1].url)
    front_url = await front.start()
    try:
        async with proxy_over({"r0": vllm_servers[0].url, "f1": front_url}, health_interval_s=0.3) as (
            proxy,
            url,
        ):
            first, second = unique("before"), unique("while-down")
            status, _ = await post_json(
                f"{url}/v1/load_lora_adapter", {"lora_name": first, "lora_path": str(adapter_dir)}
            )
            assert status == 200

            front.down = True
            # Requests that land on the dead replica get its 503, are retried on r0, and succeed.
            results = [
                await post_json(
                    f"{url}/v1/completions", {"model": first, "prompt": f"{i}+2", "max_tokens": 2}
                )
                for i in range(4)
            ]
            assert [status for status, _ in results] == [200] * 4, results
            await wait_until(lambda: proxy.stats()["replicas"]["f1"]["state"] == "unhealthy", timeout=10)
            stats = proxy.stats()
            assert stats["retries"] >= 1 and stats["replicas"]["f1"]["requests"] >= 1
            assert set(stats["retried"]) == {"f1"} and set(stats["retried"]["f1"]) == {"error_answer"}  # 503s
            # While it is away, a new version is published on the replicas that are active.
            status, body = await post_json(
                f"{url}/v1/load_lora_adapter", {"lora_name": second, "lora_path": str(adapter_dir)}
            )
            assert status == 200, body
            assert second not in await replica_models(vllm_servers[1])
            served_before = front.generations

            front.down = False
            # Back: it catches up (loads the version it missed) before it takes traffic again.
            await wait_until(lambda: proxy.stats()["replicas"]["f1"]["state"] == "active", timeout=60)
            assert {first, second} <= await replica_models(vllm_servers[1])
            assert proxy.stats()["replicas"]["f1"]["adapters_loaded"] == sorted([first, second])
            results = await asyncio.gather(
                *(
                    post_json(f"{url}/v1/completions", {"model": second, "prompt": f"{i}*3", "max_tokens": 2})
                    for i in range(4)
                )
            )
            assert all(status == 200 for status, _ in results)
            assert front.generations > served_before  # it serves again
            async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
                metrics = await r.text()
            assert 'rl_proxy_replica_active{replica="f1"} 1.0' in metrics
            assert "rl_proxy_retries_total" in metrics
    finally:
        await front.stop()


@pytest.fixture
def doomed_server(tiny_model_dir, tmp_path):
    """A third, private vLLM server, for a test that kills it."""
    server = VLLMServer(
        ServerSpec(model=str(tiny_model_dir), port=free_port(), cpu_cores=(0,)), tmp_path / "doomed.log"
    )
    server.start()
    try:
        asyncio.run(server.wait_healthy(300))
        yield server
    finally:
        server.stop(grace_s=5)


async def post_routed(url: str, payload: dict) -> tuple[int, dict, str | None]:
    """POST a generation; its status, JSON body and the replica that answered it."""
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as r:
        return r.status, await r.json(), r.headers.get(REPLICA_HEADER)


async def read_sse_until_first_event(response: aiohttp.ClientResponse) -> bytes:
    received = b""
    while b"\n\n" not in received:
        chunk = await response.content.readany()
        assert chunk, "stream ended before its first event"
        received += chunk
    return received


async def test_killed_replica_request_is_retried_elsewhere(doomed_server, vllm_servers, tiny_model_dir):
    model, prompt = str(tiny_model_dir), "7+8="
    long_request = {"model": model, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    async with proxy_over({"doomed": doomed_server.url}, health_interval_s=30) as (proxy, url):
        # One request first, so the prompt's blocks are recorded for the doomed replica: with r0 added
        # next, affinity sends the same prompt there.
        status, _ = await post_json(f"{url}/v1/completions", {**long_request, "max_tokens": 1})
        assert status == 200
        await proxy.add_replica("r0", vllm_servers[0].url)

        async with aiohttp.ClientSession() as session:
            stream = await session.post(f"{url}/v1/completions", json={**long_request, "stream": True})
            assert stream.headers[REPLICA_HEADER] == "doomed"
            received = await read_sse_until_first_event(stream)
            whole = asyncio.create_task(post_routed(f"{url}/v1/completions", long_request))
            await wait_until(lambda: proxy.stats()["replicas"]["doomed"]["in_flight"] == 2, timeout=10)

            os.killpg(doomed_server.process.pid, signal.SIGKILL)  # the whole vLLM process tree, no goodbye

            # The request that had received nothing is answered in full by r0.
            status, body, replica = await asyncio.wait_for(whole, timeout=120)
            assert status == 200, body
            assert replica == "r0"
            assert (
                body["usage"]["completion_tokens"] == 200 and body["choices"][0]["finish_reason"] == "length"
            )

            # The stream that had started ends with an error event and no [DONE], instead of hanging.
            received += await asyncio.wait_for(stream.content.read(), timeout=30)
            stream.release()
        events = [
            line[len("data: ") :] for line in received.decode().split("\n\n") if line.startswith("data: ")
        ]
        assert events[-1] != "[DONE]"
        assert "failed mid-stream" in json.loads(events[-1])["error"]["message"]

        stats = proxy.stats()
        assert stats["replicas"]["doomed"]["state"] == "unhealthy"
        assert stats["replicas"]["doomed"]["in_flight"] == 0
        assert stats["retries"] == 1 and stats["streams_broken"] == 1
        # Out of routing: everything goes to r0 now.
        status, _, replica = await post_routed(f"{url}/v1/completions", {**long_request, "max_tokens": 2})
        assert status == 200 and replica == "r0"
        await proxy.remove_replica("doomed")
        assert list(proxy.stats()["replicas"]) == ["r0"]


async def test_a_healthy_replica_that_hung_up_without_an_answer_gets_the_request_once_more(
    vllm_servers, tiny_model_dir
):  # noqa: E501
    """A connection that breaks under a request (a kept-alive connection the replica had closed, a reset)
    is no failure of the replica (its /health answers) nor of the request: it is sent once more, here to
    the same replica (the only one), and the client gets its answer, not a 502. Twice in a row is passed on."""
    flaky = PlayDead(vllm_servers[0].url)
    request = {"model": str(tiny_model_dir), "prompt": "7+8=", "max_tokens": 2, "temperature": 0}
    async with proxy_over({"r0": await flaky.start()}, health_interval_s=30) as (proxy, url):
        try:
            flaky.hang_ups = 1
            status, body, replica = await post_routed(f"{url}/v1/completions", request)
            assert (status, replica) == (200, "r0"), body
            assert flaky.generations == 2 and proxy.stats()["retries"] == 1
            assert proxy.stats()["retried"] == {"r0": {"connection": 1}}
            assert proxy.stats()["replicas"]["r0"]["state"] == "active"

            flaky.hang_ups = 2  # the resend breaks too: passed on, once, and the replica stays in routing
            status, body, _ = await post_routed(f"{url}/v1/completions", request)
            assert status == 502 and "BadGatewayError" in json.dumps(body), body
            assert flaky.generations == 4 and proxy.stats()["replicas"]["r0"]["state"] == "active"
        finally:
            await flaky.stop()


@contextlib.contextmanager
def stopped(server: VLLMServer):
    """SIGSTOP the server's whole process tree (a hung host: connections open, nothing answers); SIGCONT
    on leaving, also when the test fails."""
    os.killpg(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)


async def back_to_active(proxy: ProxyServer, replica_id: str) -> None:
    """Health rounds (the watch is slowed down in these tests) until the replica caught up again."""
    for _ in range(120):
        await proxy.check_health()
        if proxy.stats()["replicas"][replica_id]["state"] == "active":
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"{replica_id} did not come back: {proxy.stats()['replicas'][replica_id]}")


async def test_a_hung_replica_misses_its_deadlines_and_catches_up_when_it_answers(vllm_servers, adapter_dir):  # noqa: F811
    """A stopped vLLM server accepts connections and answers nothing. Each call to it is bounded: a sync
    goes on without it (load_deadline_s), a pause and a resume too, and a generation sent to it is
    retried on the other replica once the read deadline passes; each time it leaves routing, and a
    health round that finds it answering again catches it up (the versions it missed) before it serves."""
    hung = vllm_servers[1]
    timeouts = {"load_deadline_s": 3.0, "health_timeout_s": 2.0, "read_timeout_s": 4.0}
    # The health watch is all but off: what takes the hung replica out here is each call's deadline.
    async with proxy_over({"r0": vllm_servers[0].url, "r1": hung.url}, health_interval_s=600, **timeouts) as (
        proxy,
        url,
    ):
        first, second = unique("before"), unique("while-hung")
        status, body = await post_json(
            f"{url}/v1/load_lora_adapter", {"lora_name": first, "lora_path": str(adapter_dir)}
        )
        assert status == 200, body

        # A sync while r1 is stopped: loaded on r0 within the deadline, r1 out of routing.
        with stopped(hung):
            status, body = await asyncio.wait_for(
                post_json(
                    f"{url}/v1/load_lora_adapter", {"lora_name": second, "lora_path": str(adapter_dir)}
                ),
                60,
            )
            assert status == 200, body
            assert proxy.stats()["replicas"]["r1"]["state"] == "unhealthy"
            status, _, replica = await post_routed(
                f"{url}/v1/completions", {"model": second, "prompt": "1+1", "max_tokens": 2}
            )
            assert (status, replica) == (200, "r0")
        await back_to_active(proxy, "r1")
        assert second in await replica_models(hung)  # it caught up on what it missed
        assert proxy.stats()["replicas"]["r1"]["adapters_loaded"] == sorted([first, second])

        # A pause and a resume (the trainer's sync) while r1 is stopped: both answered, r1 left out.
        with stopped(hung):
            status, body = await asyncio.wait_for(post_json(f"{url}/pause?mode=keep", {}), 60)
            assert status == 200, body
            status, body = await asyncio.wait_for(post_json(f"{url}/resume", {}), 60)
            assert status == 200, body
            stats = proxy.stats()
            assert stats["replicas"]["r1"]["state"] == "unhealthy" and not stats["paused"]
        await back_to_active(proxy, "r1")

        # Generations while r1 is stopped: the one sent to r1 gets nothing for read_timeout_s, and is
        # answered by r0; r1 leaves routing.
        with stopped(hung):
            requests = [{"model": second, "prompt": f"{i}*{i}=", "max_tokens": 2} for i in range(4)]
            sent = asyncio.gather(*(post_routed(f"{url}/v1/completions", r) for r in requests))
            results = await asyncio.wait_for(sent, 60)
            assert [(status, replica) for status, _, replica in results] == [(200, "r0")] * 4, results
            stats = proxy.stats()
            assert stats["retries"] >= 1 and stats["replicas"]["r1"]["state"] == "unhealthy"
            assert stats["retried"]["r1"]["timeout"] >= 1 and "r0" not in stats["retried"]
        await back_to_active(proxy, "r1")
        status, _, _ = await post_routed(
            f"{url}/v1/completions", {"model": second, "prompt": "2+2", "max_tokens": 2}
        )
        assert status == 200


async def test_a_restarted_proxy_takes_the_replicas_back_with_what_they_hold(vllm_servers, adapter_dir):  # noqa: F811
    """The proxy's process died mid-broadcast: r0 had loaded `second`, r1 not yet. A new proxy on the same
    port is handed the replicas and what each holds (as the pool controller does with the generators'
    own record): both versions are routable again, r1 loads the one it lacked before it serves, and the
    client's retried load of `second` succeeds instead of being refused as a reused name."""
    r0, r1 = (HttpAdapterLoader(s.url) for s in vllm_servers)
    first, second = unique("held-by-both"), unique("mid-broadcast")
    path = str(adapter_dir)
    async with proxy_over({"r0": vllm_servers[0].url, "r1": vllm_servers[1].url}) as (old, url):
        status, body = await post_json(f"{url}/v1/load_lora_adapter", {"lora_name": first, "lora_path": path})
        assert status == 200, body
        await r0.load_adapter(second, path)  # the broadcast of `second` reached r0 only
        port = int(url.rsplit(":", 1)[1])
        # The process dies: its port closes, nothing is unloaded or resumed.
        await old._runner.cleanup()
        old._runner = None
        await old._pool.stop()

        new = ProxyServer(ProxyConfig())
        assert await new.start(port) == url  # where the clients look
        try:
            held = {"r0": {first: path, second: path}, "r1": {first: path}}
            await new.restore(
                {
                    rid: (s.url, None, None, held[rid])
                    for rid, s in zip(("r0", "r1"), vllm_servers, strict=True)
                }
            )
            stats = new.stats()
            assert stats["adapters_routable"] == sorted([first, second])
            assert {rid: r["state"] for rid, r in stats["replicas"].items()} == {
                "r0": "active",
                "r1": "active",
            }
            assert {first, second} <= await replica_models(vllm_servers[1])  # r1 caught up on `second`
            # The client's retry of the load the dead proxy never answered: done already, so 200.
            status, body = await post_json(
                f"{url}/v1/load_lora_adapter", {"lora_name": second, "lora_path": path}
            )
            assert status == 200, body
            # Another path under a taken name stays refused: names are never reused for other weights.
            status, _ = await post_json(
                f"{url}/v1/load_lora_adapter", {"lora_name": second, "lora_path": str(adapter_dir.parent)}
            )
            assert status == 400
            results = await asyncio.gather(
                *(post_routed(f"{url}/v1/completions", {"model": second, "prompt": f"{i}-1=", "max_tokens": 2})
                  for i in range(4))
            )  # fmt: skip
            assert all(status == 200 for status, _, _ in results), results
        finally:
            for loader in (r0, r1):
                for name in (first, second):
                    with contextlib.suppress(Exception):
                        await loader.unload_adapter(name)
            await new.stop()
