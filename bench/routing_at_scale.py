"""Routing at scale: a GRPO-shaped load on N stub replicas, the engines' prefix-cache hit rate and the
balance, our proxy beside vllm-router.

bench.routing measures the routers on two real vLLM replicas; users run tens. Here every router stands
in front of the same N replicas of bench.fleet, whose prefix-cache model counts hits as vLLM's engine
would (full blocks, keyed by the adapter, an LRU per replica): the number that saves compute, not the
router's own view of where a prefix went. The load is GRPO's: groups of G identical token-id prompts
(the tiny model's chat template: a shared system prompt, a distinct user part), sent at once, a few
groups in flight, and several adapter versions live (the groups ask for v1, then v2, then v3, as an
asynchronous run's policy moves on). Each router gets prompts of its own; the order rotates each
repetition; the fleet's caches are emptied before each run.

Balance is the busiest replica's requests against the mean (1.0: even). A router that keeps groups
together is lumpier over a short run, by whole groups; one that spreads every request evenly wastes the
cache.
"""

from __future__ import annotations

import contextlib
import statistics

import aiohttp

from bench.broadcast import _cores
from bench.common import (
    GROUP_SIZE,
    HTTP_TIMEOUT,
    group_prompts,
    grpo_load,
    json_service,
    median,
    proxy_process,
    replica_counters,
    reset_prefix_caches,
    vllm_router,
    vllm_router_available,
)
from bench.routing import Router

VERSIONS = ("scale-v1", "scale-v2", "scale-v3")


def routers() -> tuple[list[Router], list[str]]:
    ours = [Router(f"rl_cluster proxy, {p}", "proxy", p) for p in ("prefix", "round_robin")]
    if not vllm_router_available():
        return ours, ["vllm-router is not installed (`pip install vllm-router`): its rows are missing."]
    return ours + [Router(f"vllm-router, {p}", "vllm-router", p) for p in ("cache_aware", "round_robin")], []


async def _load_versions(session: aiohttp.ClientSession, proxy: str) -> None:
    """The live versions, loaded through our proxy as a trainer's syncs would (vllm-router passes any name)."""
    for name in VERSIONS:
        body = {"lora_name": name, "lora_path": f"/bucket/scale/adapters/{name}"}
        async with session.post(f"{proxy}/v1/load_lora_adapter", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"load of {name} answered {r.status}: {(await r.text())[:300]}")


async def _stub_stats(session: aiohttp.ClientSession, urls: list[str]) -> list[dict]:
    stats = []
    for url in urls:
        async with session.get(f"{url}/_stub/stats") as r:
            stats.append(await r.json())
    return stats


def _max_over_mean(values: list[float]) -> float:
    mean = statistics.mean(values)
    return max(values) / mean if mean else float("nan")


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    n, groups = plan.scale_routing_replicas, plan.scale_routing_groups
    proxy_core, fleet_core = _cores()
    candidates, notes = routers()
    runs: dict[str, list[dict]] = {r.label: [] for r in candidates}
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        urls = await stack.enter_async_context(
            json_service(
                ["-m", "bench.fleet", str(n), "--load-ms", "5"], log_dir / "fleet.log", cores=fleet_core
            )
        )
        front = await _start_fronts(stack, session, candidates, urls, log_dir, proxy_core)
        for rep in range(plan.reps):
            order = candidates[rep % len(candidates) :] + candidates[: rep % len(candidates)]
            for index, router in enumerate(order):
                prompts = group_prompts(tokenizer, groups, seed=5000 + 1000 * rep + index)
                runs[router.label].append(
                    await _measure(session, router, front[router.label], urls, prompts, plan)
                )
    rows = []
    for router in candidates:
        rs = runs[router.label]
        rows.append({"router": router.label, "reps": len(rs),
                     **{k: median([r[k] for r in rs]) for k in rs[0]}})  # fmt: skip
    return {
        "rows": rows,
        "notes": notes,
        "load": {
            "replicas": n,
            "groups": groups,
            "group_size": GROUP_SIZE,
            "versions": len(VERSIONS),
            "groups_in_flight": plan.scale_routing_groups_in_flight,
            "max_tokens": plan.max_tokens,
            "prompt_tokens": len(prompts[0]),
        },  # fmt: skip
        "runs": runs,
    }


async def _start_fronts(stack: contextlib.AsyncExitStack, session, candidates: list[Router], urls: list[str],
                        log_dir, cores: set[int] | None) -> dict[str, str]:  # fmt: skip
    """Every router in front of the same stub replicas, for as long as `stack` holds them (our proxy with
    the adapter versions loaded); label -> URL."""
    front = {}
    for router in candidates:
        if router.kind == "proxy":
            replicas = {f"s{i}": url for i, url in enumerate(urls)}
            log = log_dir / f"proxy-{router.policy}.log"
            front[router.label] = await stack.enter_async_context(
                proxy_process(replicas, log, router.policy, cores=cores)
            )
            await _load_versions(session, front[router.label])
        else:
            log = log_dir / f"vllm-router-{router.policy}.log"
            front[router.label] = await stack.enter_async_context(
                vllm_router(urls, router.policy, log, cores=cores)
            )
    return front


async def _measure(session, router: Router, url: str, urls: list[str], prompts, plan) -> dict:
    """One router's run on empty caches: the engines' hit rate, how evenly the requests spread, and the
    throughput; a failed request fails the benchmark."""
    groups = plan.scale_routing_groups
    await reset_prefix_caches(session, urls)
    before = [await replica_counters(session, u) for u in urls]
    stats_before = await _stub_stats(session, urls)
    load = await grpo_load(
        session, url, lambda g: VERSIONS[g * len(VERSIONS) // groups], prompts,
        max_tokens=plan.max_tokens, groups_in_flight=plan.scale_routing_groups_in_flight,
    )  # fmt: skip
    if load.errors:
        raise RuntimeError(f"{router.label}: {load.errors} requests failed: {load.first_error}")
    after = [await replica_counters(session, u) for u in urls]
    stats = await _stub_stats(session, urls)
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    requests = [s["requests"] - b["requests"] for s, b in zip(stats, stats_before, strict=True)]
    return {
        "cache_hit_rate": hits / queries if queries else float("nan"),
        "requests_max_over_mean": _max_over_mean(requests),
        "replicas_used": sum(1 for r in requests if r),
        "throughput": load.throughput,
    }
