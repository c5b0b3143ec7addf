"""Routing: our prefix-aware proxy against round-robin, least-loaded and vllm-router, on the same two
replicas under the same GRPO-shaped load.

Every router sits in front of the same taps (bench.tap), one per replica, so "which replica served
which group" is observed the same way for all of them. Before each run the replicas' prefix caches are
emptied and each run gets user prompts of its own; the order of the routers rotates every repetition.
All routers are sent the base model name: vllm-router has no notion of our adapter versions, and the
comparison must be the same load for everyone.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import aiohttp

from bench.common import (
    GROUP_SIZE,
    HTTP_TIMEOUT,
    group_prompts,
    grpo_load,
    median,
    paired_ratio,
    proxy_process,
    replica_counters,
    reset_prefix_caches,
    tap_logs,
    taps,
    vllm_router,
    vllm_router_available,
)
from bench.proxy_process import routing_policies
from bench.tap import prompt_key


@dataclass(frozen=True)
class Router:
    label: str
    kind: str  # "proxy" or "vllm-router"
    policy: str


def routers() -> tuple[list[Router], list[str]]:
    """The routers this build can run, and notes on those it cannot."""
    notes = []
    ours = [Router(f"rl_cluster proxy, {p}", "proxy", p) for p in routing_policies()]
    if len(ours) == 1:
        notes.append(
            "Round-robin and least-loaded rows of our proxy are missing: this build's ProxyConfig has no "
            "`routing_policy` field yet, so only its prefix-aware policy could be measured."
        )
    theirs = []
    if vllm_router_available():
        theirs = [Router(f"vllm-router, {p}", "vllm-router", p) for p in ("cache_aware", "round_robin")]
    else:
        notes.append("vllm-router is not installed (`pip install vllm-router`): its rows are missing.")
    return ours + theirs, notes


def affinity_rate(prompt_keys: list[str], per_replica: list[list[str]]) -> float:
    """Mean over groups of the share of the group's requests that reached its majority replica."""
    shares = []
    for key in prompt_keys:
        counts = [Counter(seen)[key] for seen in per_replica]
        total = sum(counts)
        if total:
            shares.append(max(counts) / total)
    return sum(shares) / len(shares) if shares else float("nan")


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    replica_urls = [s.url for s in servers]
    candidates, notes = routers()
    runs: dict[str, list[dict]] = {r.label: [] for r in candidates}
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        tap_urls = await stack.enter_async_context(taps(replica_urls, log_dir))
        urls = await _start_routers(stack, candidates, tap_urls, log_dir)
        for rep in range(plan.reps):
            order = candidates[rep % len(candidates) :] + candidates[: rep % len(candidates)]
            for index, router in enumerate(order):
                prompts = group_prompts(tokenizer, plan.routing_groups, seed=1000 * rep + index + 1)
                runs[router.label].append(
                    await _measure(
                        session, router, urls[router.label], replica_urls, tap_urls, prompts, model_dir, plan
                    )
                )
    baseline = [r["throughput"] for r in runs[candidates[0].label]]
    return {
        "rows": [_row(router.label, runs[router.label], baseline) for router in candidates],
        "notes": notes,
        "load": {
            "groups": plan.routing_groups,
            "group_size": GROUP_SIZE,
            "groups_in_flight": plan.groups_in_flight,
            "max_tokens": plan.max_tokens,
            "prompt_tokens": len(prompts[0]),
        },
        "runs": runs,
    }


async def _start_routers(stack: contextlib.AsyncExitStack, candidates: list[Router], tap_urls: list[str],
                         log_dir) -> dict[str, str]:  # fmt: skip
    """Every router in front of the same taps, for as long as `stack` holds them; label -> URL."""
    urls = {}
    for router in candidates:
        if router.kind == "proxy":
            replicas = {f"r{i}": url for i, url in enumerate(tap_urls)}
            cm = proxy_process(replicas, log_dir / f"proxy-{router.policy}.log", router.policy)
        else:
            cm = vllm_router(tap_urls, router.policy, log_dir / f"vllm-router-{router.policy}.log")
        urls[router.label] = await stack.enter_async_context(cm)
    return urls


async def _measure(session, router: Router, url: str, replica_urls: list[str], tap_urls: list[str], prompts,
                   model_dir, plan) -> dict:  # fmt: skip
    """One router's run on empty caches: its throughput, and where the groups went (seen by the taps and
    by the replicas' own cache counters); a failed request fails the benchmark."""
    await reset_prefix_caches(session, replica_urls)
    await tap_logs(session, tap_urls)  # drop what earlier traffic (health checks aside) left
    before = [await replica_counters(session, u) for u in replica_urls]
    load = await grpo_load(
        session,
        url,
        str(model_dir),
        prompts,
        max_tokens=plan.max_tokens,
        groups_in_flight=plan.groups_in_flight,
    )
    after = [await replica_counters(session, u) for u in replica_urls]
    seen = await tap_logs(session, tap_urls)
    if load.errors:
        raise RuntimeError(f"{router.label}: {load.errors} requests failed: {load.first_error}")
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    return {
        "throughput": load.throughput,
        "affinity": affinity_rate([prompt_key(p) for p in prompts], seen),
        "cache_hit_rate": hits / queries if queries else float("nan"),
        "share_on_busier_replica": max(len(s) for s in seen) / max(1, sum(len(s) for s in seen)),
    }


def _row(label: str, rs: list[dict], baseline: list[float]) -> dict:
    """A router's row: medians over its runs, its throughput against ours (paired by repetition)."""
    return {
        "router": label,
        "affinity": median([r["affinity"] for r in rs]),
        "cache_hit_rate": median([r["cache_hit_rate"] for r in rs]),
        "share_on_busier_replica": median([r["share_on_busier_replica"] for r in rs]),
        "throughput": median([r["throughput"] for r in rs]),
        "throughput_range": (min(r["throughput"] for r in rs), max(r["throughput"] for r in rs)),
        "throughput_vs_ours": paired_ratio([r["throughput"] for r in rs], baseline),
        "reps": len(rs),
    }
