"""A pass-through in front of each vLLM replica that notes which prompt each generation request carried.

Neither our proxy nor vllm-router says which replica served a request, so the routing benchmark puts
one tap in front of every replica and asks the taps afterwards: the share of a GRPO group's requests
that reached its majority replica is the affinity rate, measured the same way for every router. The
taps run in their own process (so their work is not charged to the load generator's event loop) and
cost every router the same extra hop.

    python -m bench.tap UPSTREAM_URL [UPSTREAM_URL ...]   # prints one JSON line: the taps' URLs
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import sys

import aiohttp
from aiohttp import web

HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def prompt_key(prompt) -> str:
    """A short, stable key for a prompt (token ids or text): equal prompts, equal keys."""
    return hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:16]


def make_tap(upstream: str, session: aiohttp.ClientSession) -> web.Application:
    seen: list[str] = []

    async def log(request: web.Request) -> web.Response:
        keys = list(seen)
        seen.clear()
        return web.json_response({"prompts": keys})

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        if request.method == "POST" and request.path.endswith("/completions"):
            with contextlib.suppress(ValueError, AttributeError):
                seen.append(prompt_key(json.loads(body).get("prompt")))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with session.request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as r:
            payload = await r.read()
            return web.Response(body=payload, status=r.status, content_type=r.content_type)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/_tap/log", log)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def serve(upstreams: list[str]) -> None:
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
    )
    urls = []
    for upstream in upstreams:
        runner = web.AppRunner(make_tap(upstream.rstrip("/"), session), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    print(json.dumps(urls), flush=True)
    await asyncio.Event().wait()  # until the benchmark terminates this process


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1:]))
