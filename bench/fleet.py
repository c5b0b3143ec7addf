"""A fleet of stub replicas in one process: the parts of vLLM's API the proxy uses, and no model.

Each replica is one listening port of one aiohttp server, with its own state: the adapters it holds
(listed by /v1/models, as the proxy checks after every load), a load that takes `--load-ms` (with +-20 %
jitter: replicas never finish a broadcast in the same instant) and fails with `--fail-rate`, /pause and
/resume, /server_info, and a canned completion. Cheap enough for hundreds of replicas on one core: what
a benchmark of the proxy alone runs against (bench.broadcast, bench.routing_at_scale), never what makes a
test of the system pass.

Each replica also models vLLM's prefix cache (PrefixCacheModel): a token-id prompt is cut into full
blocks, chained hashes keyed by the requested model (vLLM keys a LoRA's blocks by the adapter), looked up
from the first block on, then kept in an LRU of `--cache-blocks` blocks. /metrics reports the counts as
vLLM does (`vllm:prefix_cache_queries_total` and `_hits_total`, in tokens), /reset_prefix_cache empties
it, and a completion takes as long as its uncached prompt tokens and its output tokens would
(`--prefill-us`, `--decode-ms`, sleeping: the fleet's core stays free). /_stub/stats: the completions
a replica answered.

    python -m bench.fleet N [--load-ms 50] [--fail-rate 0]   # prints the N URLs as one JSON line
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import OrderedDict
from collections.abc import Sequence

from aiohttp import web

MODEL = "stub-model"
COMPLETION = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "text": " 4", "logprobs": None, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}  # fmt: skip


class PrefixCacheModel:
    """One replica's prefix cache, as vLLM keeps it: full blocks of `block_tokens`, each hash covering the
    whole prefix up to it, an LRU of `capacity` blocks; hits are the leading blocks already held."""

    def __init__(self, capacity: int, block_tokens: int):
        self.capacity, self.block_tokens = capacity, block_tokens
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = self.hits = 0  # tokens, as vLLM's counters

    def lookup(self, model: str, prompt: Sequence[int]) -> int:
        """Count the prompt's tokens as queried and its cached leading blocks as hit; keep its blocks.
        Returns the tokens hit."""
        hashes, previous = [], hash(model)
        for start in range(0, len(prompt) - self.block_tokens + 1, self.block_tokens):
            previous = hash((previous, tuple(prompt[start : start + self.block_tokens])))
            hashes.append(previous)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks:
            hit += 1
        for block in hashes:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        self.queries += len(prompt)
        self.hits += hit * self.block_tokens
        return hit * self.block_tokens


class Fleet:
    def __init__(self, load_s: float, fail_rate: float, seed: int = 0, cache_blocks: int = 4096,
                 block_tokens: int = 16, prefill_s: float = 20e-6, decode_s: float = 1e-3):  # fmt: skip
        self.load_s, self.fail_rate = load_s, fail_rate
        self.rng = random.Random(seed)
        self.loaded: dict[int, set[str]] = {}  # port -> adapters it holds
        self.loads: dict[int, int] = {}  # port -> loads it answered
        self.cache_blocks, self.block_tokens = cache_blocks, block_tokens
        self.prefill_s, self.decode_s = prefill_s, decode_s  # per uncached prompt token, per output token
        self.caches: dict[int, PrefixCacheModel] = {}
        self.requests: dict[int, int] = {}  # port -> completions answered

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

    def _cache(self, port: int) -> PrefixCacheModel:
        if port not in self.caches:
            self.caches[port] = PrefixCacheModel(self.cache_blocks, self.block_tokens)
        return self.caches[port]

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        port, prompt = self._port(request), body.get("prompt")
        uncached = 0
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            uncached = len(prompt) - self._cache(port).lookup(str(body.get("model")), prompt)
        self.requests[port] = self.requests.get(port, 0) + 1
        await asyncio.sleep(uncached * self.prefill_s + int(body.get("max_tokens") or 1) * self.decode_s)
        return web.json_response(COMPLETION)

    async def metrics(self, request: web.Request) -> web.Response:
        cache = self._cache(self._port(request))
        lines = []  # as vLLM writes them (prometheus_client's exposition of a Counter)
        for name, value in (("queries", cache.queries), ("hits", cache.hits)):
            lines += [f"# HELP vllm:prefix_cache_{name}_total Prefix cache {name}, in tokens.",
                      f"# TYPE vllm:prefix_cache_{name}_total counter", f"vllm:prefix_cache_{name}_total {value}"]  # fmt: skip
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self._cache(self._port(request)).blocks.clear()
        return web.Response()

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests.get(self._port(request), 0)})

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models),
            web.get("/server_info", self.server_info), web.post("/v1/load_lora_adapter", self.load),
            web.post("/v1/unload_lora_adapter", self.unload), web.post("/pause", self.ok),
            web.post("/resume", self.ok), web.post("/v1/completions", self.complete),
            web.get("/metrics", self.metrics), web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.get("/_stub/stats", self.stats),
        ])  # fmt: skip
        return app


async def serve(count: int, fleet: Fleet) -> None:
    runner = web.AppRunner(fleet.app(), access_log=None)
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
    parser.add_argument("--cache-blocks", type=int, default=4096, help="prefix-cache blocks per replica")
    parser.add_argument(
        "--block-tokens", type=int, default=16, help="tokens per cache block (vLLM's GPU default)"
    )
    parser.add_argument(
        "--prefill-us", type=float, default=20.0, help="microseconds per uncached prompt token"
    )
    parser.add_argument("--decode-ms", type=float, default=1.0, help="milliseconds per output token")
    args = parser.parse_args(argv)
    fleet = Fleet(args.load_ms / 1000, args.fail_rate, cache_blocks=args.cache_blocks,
                  block_tokens=args.block_tokens, prefill_s=args.prefill_us / 1e6, decode_s=args.decode_ms / 1000)  # fmt: skip
    asyncio.run(serve(args.count, fleet))


if __name__ == "__main__":
    main()
