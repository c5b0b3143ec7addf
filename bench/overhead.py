"""Proxy overhead: the same requests straight to one vLLM server, through our proxy (one replica) and
through vllm-router (one worker). Completions are 2 tokens long so that what the hop costs is visible
next to what the server does; the prompt repeats, so the server answers from its prefix cache."""

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


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    server_url = servers[0].url
    prompt = group_prompts(tokenizer, 1, seed=7)[0]
    notes = []
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        paths = {"direct to vLLM": server_url}
        paths["rl_cluster proxy"] = await stack.enter_async_context(
            proxy_process({"r0": server_url}, log_dir / "proxy-overhead.log")
        )
        if vllm_router_available():
            paths["vllm-router (cache_aware)"] = await stack.enter_async_context(
                vllm_router([server_url], "cache_aware", log_dir / "vllm-router-overhead.log")
            )
        else:
            notes.append("vllm-router is not installed: its row is missing.")
        labels = list(paths)
        runs: dict[str, list[dict]] = {label: [] for label in labels}
        # One warm-up pass per path: connection pools, the server's cache of this prompt.
        for url in paths.values():
            await request_stream(session, url, str(model_dir), prompt, count=8, concurrency=4, max_tokens=1)
        # Many short rounds that alternate the paths: a slow phase of the shared machine then lands on
        # every path instead of on whichever ran during it.
        rounds = plan.reps * 4
        for rep in range(rounds):
            for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
                load = await request_stream(
                    session,
                    paths[label],
                    str(model_dir),
                    prompt,
                    count=max(8, plan.overhead_requests // 4),
                    concurrency=plan.overhead_concurrency,
                    max_tokens=MAX_TOKENS,
                )
                if load.errors:
                    raise RuntimeError(f"{label}: {load.errors} requests failed: {load.first_error}")
                runs[label].append(
                    {
                        "throughput": load.throughput,
                        "p50_ms": 1000 * quantile(load.latencies_s, 0.5),
                        "p99_ms": 1000 * quantile(load.latencies_s, 0.99),
                    }
                )
    direct = runs[labels[0]]
    rows = []
    for label in labels:
        rs = runs[label]
        rows.append(
            {
                "path": label,
                "throughput": median([r["throughput"] for r in rs]),
                "throughput_vs_direct": paired_ratio(
                    [r["throughput"] for r in rs], [r["throughput"] for r in direct]
                ),
                "p50_ms": median([r["p50_ms"] for r in rs]),
                "p99_ms": median([r["p99_ms"] for r in rs]),
                "added_p50_ms": median([r["p50_ms"] - d["p50_ms"] for r, d in zip(rs, direct, strict=True)]),
                "added_p99_ms": median([r["p99_ms"] - d["p99_ms"] for r, d in zip(rs, direct, strict=True)]),
                "reps": len(rs),
            }
        )
    return {
        "rows": rows,
        "notes": notes,
        "load": {
            "requests": max(8, plan.overhead_requests // 4),
            "rounds": rounds,
            "concurrency": plan.overhead_concurrency,
            "max_tokens": MAX_TOKENS,
            "prompt_tokens": len(prompt),
        },
        "runs": runs,
    }
