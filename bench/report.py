"""BENCHMARKS.md and its plots, from the benchmarks' result dicts."""

from __future__ import annotations

import math
import os
from pathlib import Path

PLACEHOLDER = "n/a"


def num(value, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return PLACEHOLDER
    return format(value, spec)


def pct(value) -> str:
    return PLACEHOLDER if value is None or value != value else f"{100 * value:.1f}%"


def span(bounds) -> str:
    low, high = bounds
    return f"{num(low, '.1f')}-{num(high, '.1f')}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(info: dict, command: str) -> str:
    return (
        f"<sub>Machine: {info['cores']} cores, {info['cpu']}, no GPU · {info['date']} · "
        f"{info['versions']} · python {info['python']} · command: `{command}`</sub>"
    )


def routing_section(r: dict) -> str:
    load = r["load"]
    rows = [
        [
            x["router"],
            pct(x["affinity"]),
            pct(x["cache_hit_rate"]),
            pct(x["share_on_busier_replica"]),
            num(x["throughput"], ".1f"),
            span(x["throughput_range"]),
            num(x["throughput_vs_ours"], ".2f") + "x",
        ]
        for x in r["rows"]
    ]
    header = ["router", "affinity", "replica prefix-cache hit rate", "requests on busier replica",
              "completions/s", "range over reps", "throughput vs ours (prefix)"]  # fmt: skip
    return "\n\n".join(
        [
            "## 1. Routing: prefix-aware vs round-robin vs least-loaded vs vllm-router",
            f"Two vLLM replicas, {load['groups']} GRPO groups of G={load['group_size']} identical token-id prompts "
            f"({load['prompt_tokens']} tokens: a shared system prompt and a distinct user part, chat template "
            f"applied), {load['groups_in_flight']} groups in flight, {load['max_tokens']} completion tokens each "
            "(ignore_eos). Every router is sent the base model name (vllm-router knows nothing of our adapter "
            "versions). *Affinity*: share of a group's requests on the group's majority replica, seen by a "
            "pass-through tap in front of each replica. *Hit rate*: the replicas' own "
            "`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run (caches emptied "
            "before each run; vLLM's CPU block is 128 tokens, so a perfect group scores at most "
            "(G-1)/G x 128/prompt tokens). Medians over repetitions; the ratio is the median of per-repetition "
            "ratios against our prefix policy in the same repetition.",
            table(header, rows),
            "How to read the throughput column on this machine: one replica out-runs two here (see 4. "
            "Scaling), so a router that piles every request onto one replica looks fast on 2 cores and would "
            "halve capacity on a real cluster. *Requests on busier replica* shows which routers did that. "
            "The cache columns are the portable result: they say whether a group's G samples met their shared "
            "prompt prefix in one replica's KV cache. The gap between the policies is small here because "
            "only one 128-token block of each prompt can be cached: a group split over two replicas misses "
            f"once per replica, (G-2)/G x 128/{load['prompt_tokens']} = "
            f"{pct((load['group_size'] - 2) / load['group_size'] * 128 / load['prompt_tokens'])}, against "
            f"{pct((load['group_size'] - 1) / load['group_size'] * 128 / load['prompt_tokens'])} for a group kept "
            "together. It grows with longer prompts (more blocks per prompt) and more replicas.",
            *[f"> {note}" for note in r["notes"]],
        ]
    )


def overhead_section(r: dict) -> str:
    load = r["load"]
    rows = [
        [
            x["path"],
            x["load"],
            num(x["throughput"], ".1f"),
            num(x["throughput_vs_direct"], ".2f") + "x",
            num(x["throughput_vs_floor"], ".2f") + "x",
            num(x["p50_ms"], ".1f"),
            num(x["added_p50_ms"], "+.1f"),
            num(x["p50_vs_floor_ms"], "+.2f"),
            num(x["added_p99_ms"], "+.1f"),
        ]
        for x in r["rows"]
    ]
    header = ["path", "load", "requests/s", "vs direct", "vs pass-through", "p50 ms", "added p50 ms",
              "p50 vs pass-through ms", "added p99 ms"]  # fmt: skip
    tokens = ", ".join(f"{name}: {n} tokens" for name, n in load["prompt_tokens"].items())
    verdicts = []
    for name, g in r.get("goal", {}).items():
        router = g["throughput_vs_router"]

        def spread(key: str, spec: str = ".2f", unit: str = "x", g: dict = g) -> str:
            low, high = g.get(f"{key}_middle") or (None, None)
            return (
                ""
                if low is None
                else f" (middle half of the rounds: {num(low, spec)} to {num(high, spec)}{unit})"
            )

        verdicts.append(
            f"- {name}: our proxy runs at {num(g['throughput_vs_floor'])}x the pass-through's throughput"
            f"{spread('throughput_vs_floor')} (goal: at least 0.98x) with {num(g['p50_vs_floor_ms'], '+.2f')} ms "
            f"of p50 over it{spread('p50_vs_floor_ms', '+.2f', ' ms')} (goal: at most 0.5 ms): "
            f"{'met' if g['within_floor'] else 'not met'}"
            + (
                "."
                if router is None
                else f"; {num(router)}x vllm-router's throughput{spread('throughput_vs_router')} (goal: at "
                "least 1.00x)."
            )
        )
    return "\n\n".join(
        [
            "## 2. Proxy overhead",
            f"One vLLM replica; per round and path {load['requests']} requests ({tokens}) of "
            f"{load['max_tokens']} completion tokens, {load['concurrency']} in flight, in {load['rounds']} "
            "rounds that alternate the paths (so that other users' load on this shared machine hits all paths "
            "alike). *aiohttp pass-through*: a do-nothing forwarder in its own process "
            "(`bench/proxy_process.py --passthrough`, a dozen lines), the floor any Python front pays for "
            "the extra hop here. Both it and our proxy run as the ProxyActor does in a run: on uvloop (Ray "
            "runs async actors on it), with the start-up heap frozen (`rl_cluster/proxy/heap.py`). Ratios and added latencies are medians over rounds of the path against "
            "direct (or the pass-through) in the same round; differences of a few tenths of a millisecond "
            "are within this machine's noise (a negative value means just that).",
            table(header, rows),
            *verdicts,
            "How far to trust a verdict: the middle half of the rounds spans about a quarter of throughput "
            "and several milliseconds of p50 on every path (the replica, four processes and other users' "
            "work share two cores), so a median over this many rounds is good to a few percent, coarser "
            "than the goal's 0.02x and 0.5 ms. The proxy's own cost per request shows in section 6, which "
            "measures routers alone on stub upstreams.",
            *[f"> {note}" for note in r["notes"]],
        ]
    )


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


def handoff_section(r: dict) -> str:
    def cell(row, key):
        s = row.get(key)
        return f"{num(s['p50_ms'], '.0f')} / {num(s['p95_ms'], '.0f')}" if s else "-"

    rows = [
        [x["path"], cell(x, "publish_s"), cell(x, "verify_s"), cell(x, "load_s"), cell(x, "routable_s")]
        for x in r["rows"]
    ]
    header = ["path", "publish (p50 / p95 ms)", "fetch_verified alone", "load on every replica",
              "publish -> routable"]  # fmt: skip
    tiny, qwen = r["bytes"]["tiny"], r["bytes"]["qwen25_1p5b"]
    sizes = table(
        ["model", "full weights", "rank-1 LoRA (q,k,v,o,gate,up,down)", "LoRA / full"],
        [
            [
                f"tiny (this benchmark, {tiny['dtype']}, measured files)",
                f"{tiny['full_bytes'] / 1e6:.2f} MB",
                f"{tiny['lora_bytes'] / 1e3:.1f} kB (fp32, safetensors)",
                pct(tiny["lora_bytes"] / tiny["full_bytes"]),
            ],
            [
                "Qwen2.5-1.5B (computed from its config)",
                f"{qwen['full_bytes_bf16'] / 1e9:.2f} GB (bf16, {qwen['full_params'] / 1e9:.2f} B params)",
                f"{qwen['lora_bytes_fp32'] / 1e6:.2f} MB fp32 / {qwen['lora_bytes_bf16'] / 1e6:.2f} MB bf16 "
                f"({qwen['lora_params'] / 1e6:.2f} M params)",
                pct(qwen["lora_bytes_fp32"] / qwen["full_bytes_bf16"]) + " (fp32 LoRA vs bf16 model)",
            ],
        ],
    )
    return "\n\n".join(
        [
            "## 3. Handoff: publish -> routable on every replica",
            f"{r['versions']} versions per path. *publish*: `Bucket.publish_adapter` (files, then manifest). "
            "*fetch_verified alone*: the generator's verify step timed by itself (it copies, or an s3 bucket downloads, into "
            "a fresh cache). *load on every replica*: POST /v1/load_lora_adapter to the proxy, which has each "
            "replica fetch + verify into its own cache and load into vLLM, all-or-nothing; it answers once "
            "every replica has it. *publish -> routable* = publish + load. The direct row loads the same "
            "adapter straight into one vLLM server: vLLM's own cost. Ray's actor hop (GeneratorActor) is not "
            "in these numbers.",
            table(header, rows),
            "Adapter bytes against full-model bytes:",
            sizes,
            "Qwen2.5-1.5B: hidden 1536, 28 layers, intermediate 8960, 12 heads / 2 KV heads (head dim 128), "
            "vocab 151936, tied embeddings. A rank-1 LoRA adds r x (in + out) parameters per module.",
        ]
    )


def scaling_section(r: dict) -> str:
    load = r["load"]
    rows = [
        [
            str(x["generators"]),
            num(x["throughput"], ".1f"),
            span(x["throughput_range"]),
            num(x["speedup_vs_1"], ".2f") + "x",
        ]
        for x in r["rows"]
    ]
    return "\n\n".join(
        [
            "## 4. Scaling: rollout throughput with 1 and 2 generators",
            f"Through our proxy (prefix policy), {load['groups']} GRPO groups of 8, {load['groups_in_flight']} "
            f"in flight, {load['max_tokens']} completion tokens, the same two replicas (one or both registered "
            "with the proxy). Read this as a fact about this 2-core machine, not about the design: each engine is "
            "pinned to its own core, and everything else (both replicas' API-server and scheduler processes, "
            "the proxy, the load generator, and other users' work on this shared machine) runs on those same "
            "two cores. The likely reason (not measured separately) is that with one generator the second core "
            "is left to that Python work, while with two it is not, and the tiny model is so cheap that "
            "per-request Python work, not the model, sets the pace. On machines where each generator has its "
            "own cores or GPU, this is the number to re-measure.",
            table(["generators", "completions/s", "range over reps", "vs 1 generator"], rows),
        ]
    )


def async_section(r: dict) -> str:
    c, s = r["config"], r["speedup"]
    rows = [
        [
            x["mode"],
            num(x["steps_per_hour"], ".0f"),
            num(x["mean_step_s"], ".2f"),
            pct(x["trainer_idle"]),
            pct(x["generator_idle"]),
            pct(x["dropped_share"]),
            num(x["reward_at_equal_time"], ".3f"),
            num(x["reward_last_fifth"], ".3f"),
        ]
        for x in r["rows"]
    ]
    header = ["run", "steps/hour", "s/step", "trainer idle", "generator idle", "samples dropped stale",
              "reward at equal wall time", "reward, last fifth"]  # fmt: skip
    return "\n\n".join(
        [
            "## 5. Asynchronous vs synchronous GRPO",
            f"`jobs/configs/cpu_demo.toml` with trainer.max_steps={c['steps']} ({c['completions_per_step']} "
            f"completions per step in groups of {c['num_generations']}, {c['max_new_tokens']} new tokens, a sync "
            f"every {c['sync_every']} step, generator.max_loras=6), once in lockstep (trainer.mode=sync: a "
            "step's samples are generated only after the sync before it) and once asynchronously "
            f"(trainer.mode=async, max_staleness={c['max_staleness']}, groups admitted as the trainer consumes "
            "them), on the same two replicas; "
            f"{c['reps']} repetition(s). Step times are TRL's `perf/step_s` over steps 2..N (step 1 includes "
            "start-up). *Trainer idle*: sum of `perf/rollout_wait_s` / sum of step times. *Generator idle*: "
            "share of 0.25 s samples of the proxy's in-flight count (through the Ray proxy actor) with nothing "
            "in flight, averaged over replicas, from the first rollout request to the end. *Dropped*: "
            "samples discarded as too stale / (dropped + trained). *Reward at equal wall time*: mean reward "
            "of the last fifth of the steps each run had completed when the faster run finished.",
            table(header, rows),
            f"**Speedup of asynchronous over synchronous: {num(s['measured'])}x measured; ideal "
            f"{num(s['ideal'])}x; measured = {pct(s['share_of_ideal'])} of ideal.**",
            "How the ideal is derived: in the lockstep run the trainer cannot start a step before the "
            "step's rollouts exist, and they are generated only after the previous step's adapter is "
            "published, so a step costs g + t: g, the generation time per step, is what the trainer waits "
            f"for rollouts (mean `perf/rollout_wait_s` = {num(s['g_s'])} s); t, the trainer's own time per step "
            f"(step time minus that wait, adapter publication included) = {num(s['t_s'])} s. Fully overlapped, "
            "a step costs max(g, t), so the best an asynchronous trainer can do is (g + t) / max(g, t).",
            *(
                [
                    "> MEASURED ABOVE IDEAL: the lockstep baseline did work a synchronous trainer would not "
                    "(its dropped share above should be 0); the comparison is not valid."
                ]
                if s["share_of_ideal"] > 1.02
                else []
            ),
            *(
                [
                    "> Far below ideal, and why: the ideal assumes generation and training run on separate "
                    "devices, as on a GPU cluster (a trainer GPU, generator GPUs). Here the trainer and both "
                    "vLLM replicas share the same 2 CPU cores, so whatever overlaps runs slower: the "
                    "asynchronous run's step time is the two workloads contending, not max(g, t). The "
                    "lockstep run gives each phase the whole machine in turn, which is why it holds up."
                ]
                if s["share_of_ideal"] < 0.8
                else []
            ),
        ]
    )


def experience_section(r: dict) -> str:
    c = r["config"]
    rows = [[row["setting"], num(row["mean_step_s"], ".3f"), pct(row["trainer_idle"])] for row in r["rows"]]
    return "\n\n".join([
        "## 7. Experience store overhead",
        f"The same asynchronous run ({c['steps']} steps of {c['completions_per_step']} completions, groups of "
        f"{c['num_generations']}) with `experience.enabled` on and off, alternating, {c['reps']} repetitions on the "
        f"same replicas. Every pulled sample becomes a row on the training thread; Parquet shards of "
        f"{c['shard_groups']} groups are written and committed on a background thread.",
        table(["setting", "mean step (s)", "trainer idle"], rows),
        f"Step time with the store / without: **{num(r['step_time_ratio'], '.3f')}×** (paired, median). The store "
        f"wrote {num(r['bytes_per_step'] / 1024, '.1f')} KiB per step ({num(r['bytes_per_group'], '.0f')} bytes "
        f"per group, zstd Parquet); rows lost to a full write queue: {r['lost_rows']}."
        + (" Repetitions: " + ", ".join(f"{x:.3f}×" for x in r["step_time_ratios"]) + "."
           if "step_time_ratios" in r else "")
        + (" Below 1 is the shared machine's noise between repetitions, not a gain: the store's cost is "
           "smaller than that noise." if r["step_time_ratio"] < 1 else ""),
    ])  # fmt: skip


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


def failure_section(title: str, error: str) -> str:
    return f"## {title}\n\nFAILED: {error}"


def write(out: Path, plots_dir: Path, results: dict, info: dict, command: str, quick: bool) -> None:
    """Write the markdown (and the plots beside it, linked relatively)."""
    from bench.plots import draw_all

    plots = draw_all(results, plots_dir)
    sections = {
        "routing": (routing_section, "1. Routing"),
        "overhead": (overhead_section, "2. Proxy overhead"),
        "handoff": (handoff_section, "3. Handoff"),
        "scaling": (scaling_section, "4. Scaling"),
        "async_vs_sync": (async_section, "5. Asynchronous vs synchronous GRPO"),
        "capacity": (capacity_section, "6. Proxy capacity"),
        "experience": (experience_section, "7. Experience store overhead"),
        "broadcast": (broadcast_section, "8. Broadcast at scale"),
    }
    parts = [
        "# Benchmarks",
        "Generated by `make bench` (`python -m bench`); do not edit by hand. Every table's numbers come from "
        "one run, named under it (machine, date, command), with real vLLM CPU servers on the locally made tiny model, "
        "our proxy, vllm-router, moto's S3 server on loopback, Ray and TRL. Speed claims are ratios of runs "
        "made side by side in that one run on the same replicas (medians over repetitions whose order "
        "rotates): the machine is shared with other work, so absolute numbers move between runs."
        + (" **Quick mode: tiny loads, one repetition; numbers are smoke-test grade.**" if quick else ""),
        "No GPU was available to this run: GPU trainer measurements (step time, MFU, NCCL-free handoff at "
        "real model sizes) are out of scope here; the adapter-size table below computes the 1.5B case.",
    ]
    for key, (render, title) in sections.items():
        value = results.get(key)
        if value is None:
            continue
        if "error" in value:
            parts.append(failure_section(title, value["error"]))
            continue
        try:
            parts.append(render(value))
        except KeyError as e:  # results merged from an older run lack what this report shows now
            parts.append(failure_section(title, f"results of an older run lack {e}: rerun this section"))
            continue
        if key in plots:
            parts.append(f"![{title}]({os.path.relpath(plots[key], out.parent)})")
        # A section merged in from another run (python -m bench --only ... --merge) names its own run.
        parts.append(provenance(value.get("machine", info), value.get("command", command)))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(parts) + "\n")
