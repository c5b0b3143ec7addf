"""Scaling: rollout throughput through our proxy with one generator and with two, on the same
replicas under the same GRPO-shaped load. On a 2-core machine each vLLM engine is pinned to its own
core, but the load generator and the proxy share those cores, so two generators cannot reach 2x."""

from __future__ import annotations

import contextlib

import aiohttp

from bench.common import (
    HTTP_TIMEOUT,
    group_prompts,
    grpo_load,
    median,
    paired_ratio,
    proxy_process,
    reset_prefix_caches,
)


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    urls = [s.url for s in servers]
    setups = {n: {f"r{i}": urls[i] for i in range(n)} for n in range(1, len(urls) + 1)}
    runs: dict[int, list[float]] = {n: [] for n in setups}
    async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        proxies = {
            n: await stack.enter_async_context(proxy_process(replicas, log_dir / f"proxy-scaling-{n}.log"))
            for n, replicas in setups.items()
        }
        counts = list(setups)
        for rep in range(plan.reps):
            for index, n in enumerate(counts[rep % len(counts) :] + counts[: rep % len(counts)]):
                await reset_prefix_caches(session, urls)
                prompts = group_prompts(tokenizer, plan.scaling_groups, seed=5000 + 10 * rep + index)
                load = await grpo_load(
                    session,
                    proxies[n],
                    str(model_dir),
                    prompts,
                    max_tokens=plan.max_tokens,
                    groups_in_flight=plan.groups_in_flight,
                )
                if load.errors:
                    raise RuntimeError(f"{n} generators: {load.errors} requests failed: {load.first_error}")
                runs[n].append(load.throughput)
    rows = [
        {
            "generators": n,
            "throughput": median(runs[n]),
            "throughput_range": (min(runs[n]), max(runs[n])),
            "speedup_vs_1": paired_ratio(runs[n], runs[1]),
            "reps": len(runs[n]),
        }
        for n in counts
    ]
    return {
        "rows": rows,
        "load": {
            "groups": plan.scaling_groups,
            "groups_in_flight": plan.groups_in_flight,
            "max_tokens": plan.max_tokens,
        },
        "runs": {str(n): v for n, v in runs.items()},
    }
