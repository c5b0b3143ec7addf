"""Broadcast at scale: what one sync costs when the proxy loads a version on N replicas.

Our proxy, in its own process pinned to one core, in front of N stub replicas (bench.fleet, one process on
the other core) whose load takes LOAD_MS (+-20 %) as a real vLLM's takes tens of milliseconds. Each sync
is the trainer's call: load version v everywhere (the proxy checks each replica's /v1/models after its
load), then unload v-2 (the live window). What grows with N is the proxy's own work: fanning out, waiting,
checking. A sync on one replica is the baseline; each replica reads the adapter from the bucket once, so
the bucket's bytes per sync are N adapters.
"""

from __future__ import annotations

import contextlib
import os
import time

import aiohttp

from bench.capacity import cpu_seconds, pid_serving
from bench.common import json_service, median, proxy_process

LOAD_MS = 50.0
WINDOW = 2  # versions kept loaded, as trainer.max_staleness + 1 would


def _cores() -> tuple[set[int] | None, set[int] | None]:
    """The proxy on one core, the fleet on another (None: one core, shared)."""
    cores = sorted(os.sched_getaffinity(0))
    return ({cores[0]}, {cores[1]}) if len(cores) >= 2 else (None, None)


async def _syncs(proxy: str, versions: int) -> list[float]:
    """Seconds each load took, as the trainer's sync sees it (unloads, outside the window, not timed)."""
    took = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for v in range(versions):
            body = {"lora_name": f"bcast-v{v}", "lora_path": f"/bucket/bcast/adapters/bcast-v{v}"}
            start = time.perf_counter()
            async with session.post(f"{proxy}/v1/load_lora_adapter", json=body) as r:
                text = await r.text()
            took.append(time.perf_counter() - start)
            if r.status != 200:
                raise RuntimeError(f"load of bcast-v{v} answered {r.status}: {text[:500]}")
            if v >= WINDOW:
                async with session.post(
                    f"{proxy}/v1/unload_lora_adapter", json={"lora_name": f"bcast-v{v - WINDOW}"}
                ) as r:
                    if r.status != 200:
                        raise RuntimeError(f"unload answered {r.status}: {(await r.text())[:500]}")
    return took


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    proxy_core, fleet_core = _cores()
    rows = []
    for n in plan.broadcast_sizes:
        async with contextlib.AsyncExitStack() as stack:
            urls = await stack.enter_async_context(
                json_service(["-m", "bench.fleet", str(n), "--load-ms", f"{LOAD_MS:g}"],
                             log_dir / f"fleet-{n}.log", cores=fleet_core)
            )  # fmt: skip
            replicas = {f"s{i}": url for i, url in enumerate(urls)}
            proxy = await stack.enter_async_context(
                proxy_process(replicas, log_dir / f"proxy-broadcast-{n}.log", cores=proxy_core)
            )
            pids = {"proxy": pid_serving(proxy), "fleet": pid_serving(urls[0])}
            cpu0, wall0 = {k: cpu_seconds(p) for k, p in pids.items()}, time.perf_counter()
            took = await _syncs(proxy, plan.broadcast_versions)
            wall = time.perf_counter() - wall0
            cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
        rows.append({
            "replicas": n, "p50_s": median(took), "max_s": max(took), "syncs": len(took),
            # The proxy's own CPU per sync (the load, the check, the unload outside the window), and how
            # busy the fleet's core was: near 1, the stubs, not the proxy, set the pace.
            "proxy_cpu_ms_per_sync": 1000 * cpu["proxy"] / len(took),
            "fleet_cpu_share": cpu["fleet"] / wall,
        })  # fmt: skip
    one = rows[0]["p50_s"]
    for row in rows:
        row["vs_one_replica"] = row["p50_s"] / one
        # The proxy's own cost per replica beyond the first: what the fan-out adds to a sync.
        row["per_extra_replica_ms"] = (
            None if row["replicas"] == 1 else 1000 * (row["p50_s"] - one) / (row["replicas"] - 1)
        )
    return {"rows": rows, "load_ms": LOAD_MS, "window": WINDOW, "versions": plan.broadcast_versions}
