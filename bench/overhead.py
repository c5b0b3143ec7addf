"""Proxy overhead: the same requests straight to one vLLM server, through the do-nothing aiohttp
pass-through (the floor any Python front pays for the extra hop on this machine), through our proxy
(one replica) and through vllm-router (one worker), in rounds that alternate the paths.

Two loads, both with 2-token completions so that what the hop costs is visible next to what the server
does: the bench's GRPO prompt (185 token ids, the body TRL sends) and a short prompt. Each prompt
repeats, so the server answers from its prefix cache. Each path's cost is read against direct (same
round) and against the pass-through (same round): the goal for our proxy is the floor's throughput
within 0.02x and its added p50 within 0.5 ms, and at least vllm-router's throughput.
"""

from __future__ import annotations

import contextlib

import aiohttp

from bench.common import (
    HTTP_TIMEOUT,
    group_prompts,
    median,
    paired_ratio,
    proxy_process,
    quantile,
    request_stream,
    vllm_router,
    vllm_router_available,
)

MAX_TOKENS = 2
DIRECT, FLOOR, OURS = "direct to vLLM", "aiohttp pass-through (floor)", "rl_cluster proxy"
ROUTER = "vllm-router (cache_aware)"
SHORT_PROMPT = "What is 3 + 4?"


def loads(tokenizer) -> dict[str, list[int]]:
    return {
        "GRPO prompt": group_prompts(tokenizer, 1, seed=7)[0],
        "short prompt": tokenizer.encode(SHORT_PROMPT, add_special_tokens=False),
    }


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    server_url = servers[0].url
    prompts = loads(tokenizer)
    # Many short rounds rather than a few long ones: the paths of one round run within seconds of each
    # other, so a slow phase of the shared machine lands on all of them, and the medians are over more pairs.
    count = max(8, plan.overhead_requests // 8)
    rounds = plan.reps * 8
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        paths, notes = await _start_paths(stack, server_url, log_dir)
        labels = list(paths)
        runs: dict[str, dict[str, list[dict]]] = {load: {label: [] for label in labels} for load in prompts}
        # One warm-up pass per path and prompt: connection pools, the server's cache of the prompt.
        for prompt in prompts.values():
            for url in paths.values():
                await request_stream(
                    session, url, str(model_dir), prompt, count=8, concurrency=4, max_tokens=1
                )
        # Many short rounds that alternate the paths (and the loads): a slow phase of the shared machine
        # then lands on every path instead of on whichever ran during it.
        for rep in range(rounds):
            for load, prompt in prompts.items():
                for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
                    runs[load][label].append(
                        await _measure(session, label, paths[label], str(model_dir), prompt, count, plan)
                    )
    rows = [row(load, label, runs[load]) for load in prompts for label in labels]
    return {
        "rows": rows,
        "notes": notes,
        "load": {
            "requests": count,
            "rounds": rounds,
            "concurrency": plan.overhead_concurrency,
            "max_tokens": MAX_TOKENS,
            "prompt_tokens": {load: len(p) for load, p in prompts.items()},
        },
        "goal": goal(runs),
        "runs": runs,
    }


async def _start_paths(
    stack: contextlib.AsyncExitStack, server_url: str, log_dir
) -> tuple[dict[str, str], list[str]]:
    """Every path to the one server, for as long as `stack` holds them (label -> URL), and notes on those
    this machine cannot run."""
    notes = []
    paths = {DIRECT: server_url}
    paths[FLOOR] = await stack.enter_async_context(
        proxy_process({"r0": server_url}, log_dir / "passthrough-overhead.log", passthrough=True)
    )
    paths[OURS] = await stack.enter_async_context(
        proxy_process({"r0": server_url}, log_dir / "proxy-overhead.log")
    )
    if vllm_router_available():
        paths[ROUTER] = await stack.enter_async_context(
            vllm_router([server_url], "cache_aware", log_dir / "vllm-router-overhead.log")
        )
    else:
        notes.append("vllm-router is not installed: its row is missing.")
    return paths, notes


async def _measure(session, label: str, url: str, model: str, prompt: list[int], count: int, plan) -> dict:
    """One path's share of a round: `count` requests of the prompt; a failed request fails the benchmark."""
    result = await request_stream(
        session, url, model, prompt, count=count, concurrency=plan.overhead_concurrency, max_tokens=MAX_TOKENS
    )
    if result.errors:
        raise RuntimeError(f"{label}: {result.errors} requests failed: {result.first_error}")
    return {
        "throughput": result.throughput,
        "p50_ms": 1000 * quantile(result.latencies_s, 0.5),
        "p99_ms": 1000 * quantile(result.latencies_s, 0.99),
    }


def row(load: str, label: str, runs: dict[str, list[dict]]) -> dict:
    """One path under one load: medians over rounds, and paired differences against direct and the floor."""
    rs, direct, floor = runs[label], runs[DIRECT], runs[FLOOR]

    def added(key: str, base: list[dict]) -> float:
        return median([r[key] - b[key] for r, b in zip(rs, base, strict=True)])

    return {
        "load": load,
        "path": label,
        "throughput": median([r["throughput"] for r in rs]),
        "throughput_vs_direct": paired_ratio(
            [r["throughput"] for r in rs], [d["throughput"] for d in direct]
        ),
        "throughput_vs_floor": paired_ratio([r["throughput"] for r in rs], [f["throughput"] for f in floor]),
        "p50_ms": median([r["p50_ms"] for r in rs]),
        "p99_ms": median([r["p99_ms"] for r in rs]),
        "added_p50_ms": added("p50_ms", direct),
        "added_p99_ms": added("p99_ms", direct),
        "p50_vs_floor_ms": added("p50_ms", floor),
        "reps": len(rs),
    }


def goal(runs: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """Per load: does our proxy reach the floor (0.02x, 0.5 ms) and vllm-router? Paired by round, with
    the middle half of the per-round values beside each median: on a shared machine a round's ratio
    moves by several percent, and a verdict inside that spread is a tie, not a result."""
    verdicts = {}
    for load, by_path in runs.items():
        ours, floor, router = by_path[OURS], by_path[FLOOR], by_path.get(ROUTER)
        floor_ratios = ratios(ours, floor)
        gaps = [o["p50_ms"] - f["p50_ms"] for o, f in zip(ours, floor, strict=True)]
        router_ratios = None if router is None else ratios(ours, router)
        ratio, gap = median(floor_ratios), median(gaps)
        verdicts[load] = {
            "throughput_vs_floor": ratio,
            "throughput_vs_floor_middle": middle_half(floor_ratios),
            "p50_vs_floor_ms": gap,
            "p50_vs_floor_ms_middle": middle_half(gaps),
            "within_floor": ratio >= 0.98 and gap <= 0.5,
            "throughput_vs_router": None if router is None else median(router_ratios),
            "throughput_vs_router_middle": None if router is None else middle_half(router_ratios),
        }
    return verdicts


def ratios(ours: list[dict], base: list[dict]) -> list[float]:
    """Per round: our throughput over the other path's, measured in the same round."""
    return [o["throughput"] / b["throughput"] for o, b in zip(ours, base, strict=True)]


def middle_half(values: list[float]) -> list[float]:
    """The 25th and 75th percentiles."""
    return [quantile(values, 0.25), quantile(values, 0.75)]
