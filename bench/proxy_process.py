"""Our proxy (rl_cluster.proxy.server.ProxyServer) in a process of its own, in front of given replicas.

In production the proxy is a Ray actor with its own process and event loop; running it inside the
benchmark's load generator would make the two share one Python thread, which no deployment does.

    python -m bench.proxy_process r0=http://127.0.0.1:8001 [r1=...] [--policy round_robin]
    python -m bench.proxy_process r0=http://127.0.0.1:8001 --passthrough

`--passthrough` serves the floor instead: a do-nothing aiohttp forwarder to the one replica, the least
any Python front pays for the extra hop (the overhead and capacity benchmarks put it beside ours).

Both run as the ProxyActor does in production, and alike, so that the gap between the two is the proxy's
own work: on uvloop (Ray runs an async actor's event loop on uvloop when it is installed, and vLLM
installs it), with the start-up heap frozen (rl_cluster.proxy.heap).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import uvloop
from aiohttp import web

from rl_cluster.config import ProxyConfig
from rl_cluster.proxy.heap import freeze_startup_heap
from rl_cluster.proxy.server import ProxyServer


def routing_policies() -> list[str]:
    """The proxy's routing policies in this build: `prefix` always; round_robin and least_loaded once
    ProxyConfig has a `routing_policy` field."""
    field = ProxyConfig.model_fields.get("routing_policy")
    if field is None:
        return ["prefix"]
    return list(getattr(field.annotation, "__args__", ("prefix",)))


def proxy_config(policy: str | None) -> ProxyConfig:
    if policy is None or policy == "prefix" and "routing_policy" not in ProxyConfig.model_fields:
        return ProxyConfig()
    if "routing_policy" not in ProxyConfig.model_fields:
        raise SystemExit(f"ProxyConfig has no routing_policy field in this build: cannot route {policy!r}")
    return ProxyConfig(routing_policy=policy)


async def passthrough(upstream: str) -> str:
    """The floor: forward every request's body to `upstream` and its answer back, nothing else."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": request.content_type}  # vLLM refuses a body it is not told is JSON
        async with session.request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as r:
            return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("replicas", nargs="+", help="id=url")
    parser.add_argument("--policy", default=None)
    parser.add_argument("--passthrough", action="store_true", help="the do-nothing floor (one replica)")
    args = parser.parse_args()
    if args.passthrough:
        url = await passthrough(args.replicas[0].split("=", 1)[1].rstrip("/"))
        freeze_startup_heap()
        print(json.dumps(url), flush=True)
        await asyncio.Event().wait()
    proxy = ProxyServer(proxy_config(args.policy))
    url = await proxy.start()
    for spec in args.replicas:
        replica_id, replica_url = spec.split("=", 1)
        await proxy.add_replica(replica_id, replica_url)
    # The proxy learns each replica's capacity from its /server_info in the background, and vLLM builds
    # that page's environment report (seconds of CPU) on first use: wait, so no measurement meets it.
    for _ in range(300):
        if all(r["capacity"] for r in proxy.stats()["replicas"].values()):
            break
        await asyncio.sleep(0.1)
    freeze_startup_heap()
    print(json.dumps(url), flush=True)
    try:
        await asyncio.Event().wait()  # until the benchmark terminates this process
    finally:
        await proxy.stop()


if __name__ == "__main__":
    uvloop.run(main())
