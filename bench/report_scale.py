"""The scale sections of BENCHMARKS.md: one proxy in front of many stub upstreams (capacity, broadcast,
routing at scale)."""

from __future__ import annotations

import math

from bench.markdown import num, pct, table


def capacity_section(r: dict) -> str:
    load = r["load"]
    rows = [
        [
            x["router"],
            num(x["requests_per_s"], ".0f"),
            num(x["vs_ours"], ".2f") + "x",
            num(x["p50_ms"], ".1f"),
            pct(x["router_cpu_share"]),
            pct(x["load_cpu_share"]),
        ]
        for x in r["rows"]
    ]
    header = ["router", "requests/s", "vs ours", "p50 ms", "router CPU (of one core)", "load side CPU"]
    ours = r["rows"][0]["requests_per_s"]
    seed = r["seed"]
    pinning = (
        "Each router process is pinned to one core, the load generator and the stubs to the other"
        if load["pinned"]
        else "Nothing is pinned (one core)"
    )
    bound = [
        f"> {x['router']}: the load side's core was {pct(x['load_cpu_share'])} busy, so its number is a "
        "lower bound (the stubs and the load generator, not the router, may have set the pace)."
        for x in r["rows"]
        if x["load_cpu_share"] > 0.9
    ]
    return "\n\n".join(
        [
            "## 6. Proxy capacity: requests/s one router process routes",
            f"{load['upstreams']} stub upstreams that answer every completion at once with a canned vLLM-shaped "
            f"answer (no model: this measures the router alone), {load['connections']} keep-alive connections "
            f"each sending the next request as soon as the last answer arrived, {load['seconds']:.1f} s per run, "
            f"{r['rows'][0]['reps']} run(s) per router in rotating order, medians. Requests are the bench's "
            f"completion bodies ({load['prompt_tokens']} token ids, groups of 8 identical prompts). "
            f"{pinning}; the stubs and the load generator are raw asyncio protocols, far cheaper per request "
            "than any router. The pass-through row forwards to one stub and routes nothing: the floor's "
            "ceiling on this core.",
            table(header, rows),
            *_many_upstreams_line(r),
            f"**One proxy process fronts about {num(ours / seed['per_replica_rps'], ',.0f')} H200 replicas at the "
            f"seed's request rate** ({num(ours, ',.0f')} requests/s on one core / {num(seed['per_replica_rps'])} "
            f"requests/s per replica){_at_few(r)}. {seed['derivation']}",
            *bound,
            *[f"> {note}" for note in r["notes"]],
        ]
    )


def _many_upstreams_line(r: dict) -> list[str]:
    """Ours in front of many stubs against ours in front of few (results of older runs have no such row)."""
    load = r["load"]
    if "many_upstreams" not in load:
        return []
    label = f"rl_cluster proxy ({load['many_upstreams']} upstreams)"
    many = next((x for x in r["rows"] if x["router"] == label), None)
    if many is None:
        return []
    few_n, many_n = load["upstreams"], load["many_upstreams"]
    a, b = cost_per_request_us(r["rows"][0]["requests_per_s"], many["requests_per_s"], few_n, many_n)
    rate = r["seed"]["per_replica_rps"]
    return [
        f"Our proxy in front of {many_n} upstreams routes **{num(many['vs_ours'], '.2f')}x** the requests/s it "
        f"routes in front of {few_n} (the goal: at least 0.8x at 256): the per-request choice among more "
        f"replicas is what grows. Fitted through the two: **{num(a, '.0f')} us + {num(b, '.2f')} us x N per "
        f"request** on one core, so at the seed's {num(rate)} requests/s per replica **one proxy process "
        f"saturates at about {num(saturation_replicas(a, b, rate), ',.0f')} replicas** (where N x "
        f"{num(rate)} = 1e6 / ({num(a, '.0f')} + {num(b, '.2f')} N))."
    ]


def _at_few(r: dict) -> str:
    """The fronted-replicas count above is at the few-replica cost: where the many-replica row exists, say
    what it becomes once the cost's growth with N is counted."""
    lines = _many_upstreams_line(r)
    if not lines:
        return ""
    load = r["load"]
    label = f"rl_cluster proxy ({load['many_upstreams']} upstreams)"
    many = next(x for x in r["rows"] if x["router"] == label)
    a, b = cost_per_request_us(r["rows"][0]["requests_per_s"], many["requests_per_s"], load["upstreams"],
                               load["many_upstreams"])  # fmt: skip
    n = saturation_replicas(a, b, r["seed"]["per_replica_rps"])
    return f"; that is at {load['upstreams']} replicas' cost per request, and with its growth with N about {n:,.0f}"


def cost_per_request_us(few_rps: float, many_rps: float, few_n: int, many_n: int) -> tuple[float, float]:
    """(a, b) of the line a + b*N through the router's microseconds per request at two replica counts."""
    few_us, many_us = 1e6 / few_rps, 1e6 / many_rps
    b = (many_us - few_us) / (many_n - few_n)
    return few_us - b * few_n, b


def saturation_replicas(a: float, b: float, rate: float) -> float:
    """N where N replicas' requests (N x rate per second) use the whole core: rate*N*(a + b*N) = 1e6."""
    if b <= 0:
        return 1e6 / (a * rate)
    return (-a * rate + math.sqrt((a * rate) ** 2 + 4 * b * rate * 1e6)) / (2 * b * rate)


def broadcast_section(r: dict) -> str:
    rows = [
        [
            str(x["replicas"]),
            num(1000 * x["p50_s"], ".1f"),
            num(1000 * x["max_s"], ".1f"),
            num(x["vs_one_replica"], ".2f") + "x",
            "-" if x["per_extra_replica_ms"] is None else num(x["per_extra_replica_ms"], ".2f"),
            num(x["proxy_cpu_ms_per_sync"], ".1f"),
            pct(x["fleet_cpu_share"]),
            f"{x['replicas']} adapters",
        ]
        for x in r["rows"]
    ]
    return "\n\n".join([
        "## 8. Broadcast at scale: one sync's load on N replicas",
        f"Our proxy (its own process, one core) in front of N stub replicas (`bench.fleet`, one process on the "
        f"other core) whose adapter load takes {r['load_ms']:g} ms (+-20 %), as a real vLLM's takes tens of "
        f"milliseconds. Each sync is the trainer's: load version v on every replica (the proxy checks each "
        f"replica's `/v1/models` after its load) and unload the version {r['window']} before; {r['versions']} "
        "syncs per size, the load timed as the trainer sees it. What grows with N is the proxy's fan-out; "
        "each replica copies the adapter from the bucket once, so a sync reads N adapters from it.",
        table(["replicas", "p50 sync (ms)", "max (ms)", "vs 1 replica", "ms per extra replica",
               "proxy CPU per sync (ms)", "fleet core busy", "bucket reads per sync"], rows),
        "The proxy's CPU per sync is its own work for the load, the checks and the unload; where the fleet's "
        "core is near 100 % busy, the stubs set the pace and the latency is an upper bound on the proxy's. "
        + _sync_law(r["rows"]),
    ])  # fmt: skip


def _sync_law(rows: list[dict]) -> str:
    """The least-squares line of the proxy's CPU per sync against N, and the largest size's sync."""
    xs, ys = [x["replicas"] for x in rows], [x["proxy_cpu_ms_per_sync"] for x in rows]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    last = rows[-1]
    return (
        f"Fitted: **{num(mean_y - slope * mean_x, '.1f')} ms + {num(slope, '.2f')} ms x N of the proxy's CPU "
        f"per sync**; a sync on {last['replicas']} replicas took {num(1000 * last['p50_s'], '.0f')} ms (p50), "
        f"{num(last['vs_one_replica'], '.1f')}x a sync on one."
    )


def routing_at_scale_section(r: dict) -> str:
    load = r["load"]
    rows = [
        [x["router"], pct(x["cache_hit_rate"]), num(x["requests_max_over_mean"], ".2f"),
         f"{x['replicas_used']:.0f} of {load['replicas']}"]
        for x in r["rows"]
    ]  # fmt: skip
    by_name = {x["router"]: x for x in r["rows"]}
    ours, theirs = by_name.get("rl_cluster proxy, prefix"), by_name.get("vllm-router, cache_aware")
    verdict = []
    if ours and theirs:
        verdict.append(
            f"Behind ours the engines hit **{pct(ours['cache_hit_rate'])}** of the prompt tokens, spread over "
            f"{ours['replicas_used']:.0f} replicas (busiest {num(ours['requests_max_over_mean'], '.2f')}x the mean); "
            f"behind vllm-router's cache_aware {pct(theirs['cache_hit_rate'])}, over {theirs['replicas_used']:.0f} "
            f"(busiest {num(theirs['requests_max_over_mean'], '.2f')}x)."
        )
        if theirs["replicas_used"] <= load["replicas"] / 2:
            verdict.append(
                "Every prompt starts with the same system prompt, and cache_aware's tree matches on it: with "
                "its default balance thresholds, at this load, it kept sending to the replicas that had it, "
                "which a real replica would pay for in queueing (the stubs do not model batching)."
            )
    return "\n\n".join([
        "## 9. Routing at scale: the engines' prefix-cache hits on N replicas",
        f"Each router in front of the same {load['replicas']} stub replicas (`bench.fleet`), whose prefix-cache "
        "model counts hits as vLLM's engine does (full 16-token blocks keyed by the adapter, an LRU per "
        f"replica): the number that saves compute. The load is GRPO's: {load['groups']} groups of "
        f"{load['group_size']} identical token-id prompts ({load['prompt_tokens']} tokens: the tiny model's chat "
        f"template, a shared system prompt and a distinct user part), {load['groups_in_flight']} groups in "
        f"flight, {load['versions']} adapter versions asked for in turn, {load['max_tokens']} tokens each. "
        "Caches emptied before each run; medians over repetitions whose order rotates. Balance: the busiest "
        "replica's requests against the mean (1.00 is even). A stub answers after a sleep for its uncached "
        "prompt and output tokens, without modelling a batch, so throughput here would say nothing: "
        "results.json has it.",
        table(["router", "engine prefix-cache hit rate", "busiest / mean requests", "replicas used"], rows),
        *verdict,
        *r.get("notes", []),
    ])  # fmt: skip


def pool_step_section(r: dict) -> str:
    load, rules = r["load"], r["rules"]

    def seconds(value) -> str:
        return "not within the step" if value is None else f"{value:.0f}"

    rows = [
        [f"{x['node_start_s']:.0f}", str(x["needed"]), str(x["peak"]), f"{x['overshoot']:+d}",
         seconds(x["served_after_s"]), seconds(x["back_to_min_after_s"])]
        for x in r["rows"]
    ]  # fmt: skip
    return "\n\n".join([
        "## 10. The pool under a demand step",
        "The pool controller's decisions (`ScalingPolicy`, the real one) in a simulation of what it decides "
        f"about (`bench/pool_step.py`, simulated time): {load['clients']} clients each keep one request "
        f"outstanding, then {load['clients'] * load['step']} for {load['during_s']:.0f} s, then none; a replica "
        f"runs {load['slots']} requests at once, {load['service_s']:g} s each. Rules: grow above "
        f"{rules['up_in_flight']:g} in flight per replica held {rules['up_window_s']:g} s, to what the demand "
        f"needs; shrink one replica after {rules['down_window_s']:g} s idle; {rules['cooldown_s']:g} s between "
        f"changes; {rules['min_replicas']}..{rules['max_replicas']} replicas. A new replica serves after the "
        "node-start delay.",
        table(["node start (s)", "replicas needed", "peak", "overshoot", "served after (s)",
               "back to the minimum after the step (s)"], rows),
        "Served: the first moment in the step when demand on the serving replicas is at or below the "
        "threshold. Scale-in goes one replica per idle window, so the pool keeps its warm caches through "
        "a short lull.",
    ])  # fmt: skip
