"""Capacity: how many requests/s one router process routes to N upstreams that answer at once.

The upstreams are stubs (canned vLLM-shaped answers, no model), so what is measured is the router
alone: our proxy, vllm-router and the do-nothing pass-through (bench.proxy_process --passthrough, one
upstream), on the same stubs, one after the other. Each router process is pinned to one core; the
load generator and the stubs share the other core, so the two sides do not steal each other's CPU.
Both helpers are raw asyncio protocols (keep-alive HTTP/1.1, a few microseconds a request), much
cheaper than any router, so the router is the bottleneck; the report says when the load side's core
was busy enough that the router's number is only a lower bound.

    python -m bench.capacity stubs N           # prints the stubs' URLs as one JSON line
    python -m bench.capacity load URL C S PIDS # C connections for S seconds; prints one JSON line
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

from bench.common import (
    REPO,
    json_service,
    median,
    proxy_process,
    vllm_router,
    vllm_router_available,
)
from bench.http1 import response, take_message

STUB_MODEL = "stub-model"
PROMPT_TOKENS = 185  # the bench's GRPO prompt length
DISTINCT_PROMPTS = 256
GROUP_SIZE = 8  # consecutive requests share a prompt, as a GRPO group's G samples do

# -- stub upstreams ------------------------------------------------------------------------------------


def _completion_answer() -> bytes:
    """What vLLM answers a 2-token completion with logprobs and token ids (same shape, same size)."""
    choice = {"index": 0, "text": " a b", "token_ids": [321, 322], "finish_reason": "length",
              "stop_reason": None, "prompt_logprobs": None, "prompt_token_ids": None,
              "logprobs": {"text_offset": [0, 2], "token_logprobs": [-1.25, -0.5], "tokens": [" a", " b"],
                           "top_logprobs": [{" a": -1.25}, {" b": -0.5}]}}  # fmt: skip
    body = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": STUB_MODEL,
            "choices": [choice], "usage": {"prompt_tokens": PROMPT_TOKENS, "total_tokens": 187,
                                           "completion_tokens": 2}}  # fmt: skip
    return json.dumps(body).encode()


MODELS = {"object": "list", "data": [{"id": STUB_MODEL, "object": "model", "root": STUB_MODEL, "parent": None,
                                      "max_model_len": 256}]}  # fmt: skip


SERVER_INFO = {"vllm_config": {"scheduler_config": {"max_num_seqs": 256}}}  # what the proxy reads of it


class _Stub(asyncio.Protocol):
    """One upstream: answers every generation at once with the same canned completion."""

    def __init__(self, counts: list[int], index: int):
        self.counts, self.index = counts, index
        self.answers = {
            "/v1/completions": response(200, _completion_answer()),
            "/v1/chat/completions": response(200, _completion_answer()),
            "/v1/models": response(200, json.dumps(MODELS).encode()),
            "/health": response(200, b""),
            "/server_info": response(200, json.dumps(SERVER_INFO).encode()),
        }
        self.buf = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (message := take_message(self.buf)) is not None:
            first, _, _, used = message
            del self.buf[:used]
            path = first.split(" ", 2)[1].split("?", 1)[0]
            if path == "/_stub/count":
                self.transport.write(response(200, json.dumps(self.counts[self.index]).encode()))
                continue
            if path.endswith("/completions"):
                self.counts[self.index] += 1
            # Any other GET a router probes (server info, metrics) gets an empty JSON object.
            self.transport.write(self.answers.get(path) or response(200, b"{}"))


async def serve_stubs(count: int) -> None:
    loop = asyncio.get_running_loop()
    counts = [0] * count
    urls = []
    for i in range(count):
        server = await loop.create_server(lambda i=i: _Stub(counts, i), "127.0.0.1", 0)
        urls.append(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    print(json.dumps(urls), flush=True)
    await asyncio.Event().wait()  # until the benchmark terminates this process


# -- the load generator --------------------------------------------------------------------------------


def request_bodies() -> list[bytes]:
    """Completion requests as TRL sends them: token ids, a shared system part, a distinct user part."""
    rng = random.Random(11)
    shared = [rng.randrange(1, 200) for _ in range(100)]
    bodies = []
    for _ in range(DISTINCT_PROMPTS):
        prompt = shared + [rng.randrange(1, 200) for _ in range(PROMPT_TOKENS - len(shared))]
        body = {"model": STUB_MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 1.0, "n": 1,
                "logprobs": 0, "return_token_ids": True}  # fmt: skip
        bodies.append(json.dumps(body).encode())
    return bodies


class _Client(asyncio.Protocol):
    """One keep-alive connection sending one request at a time, as fast as answers come back."""

    def __init__(self, load: _Load):
        self.load, self.buf = load, bytearray()
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._send()

    def _send(self) -> None:
        if time.perf_counter() >= self.load.stop_at:
            if not self.done.done():
                self.done.set_result(None)
            return
        self.sent_at = time.perf_counter()
        self.transport.write(self.load.next_request())

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (message := take_message(self.buf)) is not None:
            first, _, _, used = message
            del self.buf[:used]
            self.load.finished(first.split(" ", 2)[1] == "200", time.perf_counter() - self.sent_at)
            self._send()

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


class _Load:
    def __init__(self, host: str, seconds: float):
        self.requests = [
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(b)}\r\n\r\n".encode()
            + b
            for b in request_bodies()
        ]
        self.sent = self.ok = self.errors = 0
        self.latencies: list[float] = []
        self.measure_from = time.perf_counter() + min(1.0, seconds / 4)  # the first second warms up
        self.stop_at = time.perf_counter() + seconds

    def next_request(self) -> bytes:
        request = self.requests[(self.sent // GROUP_SIZE) % len(self.requests)]
        self.sent += 1
        return request

    def finished(self, ok: bool, latency: float) -> None:
        if time.perf_counter() < self.measure_from:
            return
        if ok:
            self.ok += 1
            self.latencies.append(latency)
        else:
            self.errors += 1


async def generate_load(url: str, connections: int, seconds: float, watched: dict[str, int]) -> dict:
    """Keep `connections` requests in flight for `seconds`; `watched` names processes (router, stubs)
    whose CPU share over the measured window is reported too."""
    host_port = url.removeprefix("http://").rstrip("/")
    host, port = host_port.rsplit(":", 1)
    load = _Load(host_port, seconds)
    loop = asyncio.get_running_loop()
    clients = [
        (await loop.create_connection(lambda: _Client(load), host, int(port)))[1] for _ in range(connections)
    ]
    await asyncio.sleep(max(0.0, load.measure_from - time.perf_counter()))
    cpu0 = {name: cpu_seconds(pid) for name, pid in watched.items()}
    own0 = time.process_time()
    await asyncio.gather(*(c.done for c in clients))
    wall = time.perf_counter() - load.measure_from
    shares = {f"{name}_cpu_share": (cpu_seconds(pid) - cpu0[name]) / wall for name, pid in watched.items()}
    for c in clients:
        c.transport.close()
    latencies = sorted(load.latencies)
    return {
        "requests_per_s": load.ok / wall,
        "ok": load.ok,
        "errors": load.errors,
        "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else float("nan"),
        "load_cpu_share": (time.process_time() - own0) / wall + shares.pop("stubs_cpu_share", 0.0),
        **shares,
    }


# -- the benchmark -------------------------------------------------------------------------------------

# docs/training.md, "The MATH recipes": the published run of jobs/configs/qwen25_math_1p5b.toml took 53 minutes on
# H200s for its 500 steps.
SEED_RUN_MINUTES = 53


def seed_request_rate() -> dict:
    """Requests/s per replica of the published run: every completion is one request (TRL's rollout
    worker sends a group's G samples as G requests with n=1), spread over the recipe's generators."""
    import tomllib

    recipe = tomllib.loads((REPO / "jobs/configs/qwen25_math_1p5b.toml").read_text())
    steps, per_step = recipe["trainer"]["max_steps"], recipe["trainer"]["completions_per_step"]
    replicas = recipe["generator"]["replicas"]
    total_rps = steps * per_step / (SEED_RUN_MINUTES * 60)
    return {
        "per_replica_rps": total_rps / replicas,
        "derivation": (
            f"The seed's rate: the published run (`jobs/configs/qwen25_math_1p5b.toml`, docs/training.md) made {steps} "
            f"steps x {per_step} completions = {steps * per_step:,} requests (one per completion: TRL sends a "
            f"group's samples as separate n=1 requests) in {SEED_RUN_MINUTES} minutes on {replicas} H200 "
            f"generators: {total_rps:.1f} requests/s, {total_rps / replicas:.1f} per replica. That is an "
            "average; requests come in bursts of a group at a time, and a proxy kept below half its "
            "capacity still fronts half as many."
        ),
    }


def pid_serving(url: str) -> int | None:
    """The pid of the process listening on `url`'s port (a router or the stubs we started)."""
    import psutil

    port = int(url.rstrip("/").rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds a process (all its threads) used so far; NaN when unknown."""
    import psutil

    if pid is None:
        return float("nan")
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def _measure(url: str, stubs_pid: int | None, connections: int, seconds: float, cores) -> dict:
    """Run the load generator (its own process, on `cores`) against `url`; it also reports the router's
    CPU share and the load side's (generator + stubs)."""
    watched = json.dumps({"router": pid_serving(url), "stubs": stubs_pid})
    args = ["-m", "bench.capacity", "load", url, str(connections), str(seconds), watched]
    async with json_service(args, Path(os.devnull), timeout_s=seconds + 60, cores=cores) as result:
        return result


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    """The routers in turn on the same stubs, rounds rotating the order; medians over rounds."""
    cores = sorted(os.sched_getaffinity(0))
    router_core = {cores[0]} if len(cores) > 1 else None
    load_core = {cores[-1]} if len(cores) > 1 else None
    n, many = plan.capacity_upstreams, plan.capacity_many_upstreams
    async with contextlib.AsyncExitStack() as stack:
        stubs = await stack.enter_async_context(
            json_service(["-m", "bench.capacity", "stubs", str(max(n, many))], log_dir / "stubs.log",
                         cores=load_core)
        )  # fmt: skip
        stubs_pid = pid_serving(stubs[0])
        paths, notes = await _start_routers(stack, stubs, n, many, log_dir, router_core)
        labels = list(paths)
        runs: dict[str, list[dict]] = {label: [] for label in labels}
        for url in paths.values():  # warm-up, not counted: connection pools, the first requests' costs
            await _measure(url, stubs_pid, plan.capacity_connections, 1.0, load_core)
        for rep in range(plan.reps):
            for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
                result = await _measure(
                    paths[label], stubs_pid, plan.capacity_connections, plan.capacity_seconds, load_core
                )
                if result["errors"] or not result["ok"]:
                    raise RuntimeError(
                        f"{label}: {result['errors']} of {result['ok'] + result['errors']} failed"
                    )
                runs[label].append(result)
    ours = [r["requests_per_s"] for r in runs[labels[0]]]
    rows = [_row(label, runs[label], ours) for label in labels]
    return {
        "rows": rows,
        "notes": notes,
        "load": {
            "upstreams": n,
            "many_upstreams": many,
            "connections": plan.capacity_connections,
            "seconds": plan.capacity_seconds,
            "prompt_tokens": PROMPT_TOKENS,
            "pinned": router_core is not None,
        },
        "seed": seed_request_rate(),
        "runs": runs,
    }


async def _start_routers(stack: contextlib.AsyncExitStack, stubs: list[str], n: int, many: int, log_dir,
                         cores: set[int] | None) -> tuple[dict[str, str], list[str]]:  # fmt: skip
    """Every router on the stubs, for as long as `stack` holds them (label -> URL; ours first), and notes
    on those this machine cannot run."""
    notes = []
    paths = {}
    # Ours on the first n stubs (the row every other is compared with), and on `many` of them: what the
    # per-request cost does as the replica count grows.
    for size in (n, many):
        paths[f"rl_cluster proxy ({size} upstreams)"] = await stack.enter_async_context(
            proxy_process(
                {f"s{i}": u for i, u in enumerate(stubs[:size])}, log_dir / f"proxy-{size}.log", cores=cores,
            )
        )  # fmt: skip
    if vllm_router_available():
        paths[f"vllm-router, cache_aware ({n} upstreams)"] = await stack.enter_async_context(
            vllm_router(stubs[:n], "cache_aware", log_dir / "vllm-router.log", cores=cores)
        )
    else:
        notes.append("vllm-router is not installed: its row is missing.")
    paths["aiohttp pass-through (1 upstream)"] = await stack.enter_async_context(
        proxy_process({"s0": stubs[0]}, log_dir / "passthrough.log", passthrough=True, cores=cores)
    )
    return paths, notes


def _row(label: str, rs: list[dict], ours: list[float]) -> dict:
    """A router's row: medians over rounds, its rate against ours paired by round."""
    return {
        "router": label,
        "requests_per_s": median([r["requests_per_s"] for r in rs]),
        "vs_ours": median([r["requests_per_s"] / o for r, o in zip(rs, ours, strict=True)]),
        "p50_ms": median([r["p50_ms"] for r in rs]),
        "router_cpu_share": median([r.get("router_cpu_share", float("nan")) for r in rs]),
        "load_cpu_share": median([r["load_cpu_share"] for r in rs]),
        "reps": len(rs),
    }


def main(argv: list[str]) -> None:
    with contextlib.suppress(ImportError):  # the helpers only: a cheaper loop leaves more for the router
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if argv[0] == "stubs":
        asyncio.run(serve_stubs(int(argv[1])))
    elif argv[0] == "load":
        watched = {k: v for k, v in json.loads(argv[4]).items() if v is not None}
        result = asyncio.run(generate_load(argv[1], int(argv[2]), float(argv[3]), watched))
        print(json.dumps(result), flush=True)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
