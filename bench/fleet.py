"""A fleet of stub replicas in one process: the parts of vLLM's API the proxy uses, and no model.

Each replica is one listening port of one aiohttp server, with its own state: the adapters it holds
(listed by /v1/models, as the proxy checks after every load), a load that takes `--load-ms` (with +-20 %
jitter: replicas never finish a broadcast in the same instant) and fails with `--fail-rate`, /pause and
/resume, /server_info, and a canned completion. Cheap enough for hundreds of replicas on one core: what
a benchmark of the proxy alone runs against (bench.broadcast), never what makes a test of the system pass.

    python -m bench.fleet N [--load-ms 50] [--fail-rate 0]   # prints the N URLs as one JSON line
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

from aiohttp import web

MODEL = "stub-model"
COMPLETION = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "text": " 4", "logprobs": None, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}  # fmt: skip


class Fleet:
    def __init__(self, load_s: float, fail_rate: float, seed: int = 0):
        self.load_s, self.fail_rate = load_s, fail_rate
        self.rng = random.Random(seed)
        self.loaded: dict[int, set[str]] = {}  # port -> adapters it holds
        self.loads: dict[int, int] = {}  # port -> loads it answered

    def _port(self, request: web.Request) -> int:
        return request.transport.get_extra_info("sockname")[1]

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        held = sorted(self.loaded.get(self._port(request), ()))
        data = [{"id": MODEL, "object": "model", "root": MODEL, "parent": None}]
        data += [{"id": name, "object": "model", "root": name, "parent": MODEL} for name in held]
        return web.json_response({"object": "list", "data": data})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"vllm_config": {"scheduler_config": {"max_num_seqs": 256}}})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        port = self._port(request)
        await asyncio.sleep(self.load_s * self.rng.uniform(0.8, 1.2))
        if self.rng.random() < self.fail_rate:
            return web.json_response({"error": {"message": "stub: load failed", "code": 500}}, status=500)
        self.loaded.setdefault(port, set()).add(body["lora_name"])
        self.loads[port] = self.loads.get(port, 0) + 1
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        held = self.loaded.get(self._port(request), set())
        if name not in held:
            return web.json_response(
                {"error": {"message": f"adapter {name} not found", "code": 404}}, status=404
            )
        held.discard(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response()

    async def complete(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(COMPLETION)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models),
            web.get("/server_info", self.server_info), web.post("/v1/load_lora_adapter", self.load),
            web.post("/v1/unload_lora_adapter", self.unload), web.post("/pause", self.ok),
            web.post("/resume", self.ok), web.post("/v1/completions", self.complete),
        ])  # fmt: skip
        return app


async def serve(count: int, load_s: float, fail_rate: float) -> None:
    runner = web.AppRunner(Fleet(load_s, fail_rate).app(), access_log=None)
    await runner.setup()
    urls = []
    for _ in range(count):
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    print(json.dumps(urls), flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("count", type=int)
    parser.add_argument("--load-ms", type=float, default=50.0, help="how long a load takes (+-20 %%)")
    parser.add_argument("--fail-rate", type=float, default=0.0, help="share of loads answered with a 500")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.count, args.load_ms / 1000, args.fail_rate))


if __name__ == "__main__":
    main()
