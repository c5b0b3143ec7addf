"""Asynchronous GRPO against the lockstep loop of synchronous trainers: the same short training run
(jobs/configs/cpu_demo.toml with fewer steps) with trainer.mode=sync and trainer.mode=async, on the same
two vLLM replicas (bench/training.py runs them, beside the experience store's pair).

The pieces are those of a real run (a Ray cluster of our own, the ProxyActor, TrainerActor with TRL's
AsyncGRPOTrainer, a directory bucket); the replicas are the benchmark's own servers, registered with a
control that fetches and verifies each version as GeneratorActor does, so no second pair of vLLM
servers has to start. While the trainer runs, the proxy's in-flight counts are sampled every 0.25 s
through the actor: the share of samples with nothing in flight is the generators' idle fraction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import aiohttp

from bench.common import HTTP_TIMEOUT, REPO
from bench.handoff import VerifyingControl
from rl_cluster.bucket import Bucket
from rl_cluster.connection import runtime_env
from rl_cluster.core.summary import trainer_idle
from rl_cluster.models import model_fingerprint

DEMO_CONFIG = REPO / "jobs" / "configs" / "cpu_demo.toml"
POLL_S = 0.25
MODES = {"synchronous": "sync", "asynchronous": "async"}  # trainer.mode


def mode_label(mode: str, config) -> str:
    if MODES[mode] == "sync":
        return f"{mode} (lockstep)"
    return f"{mode} (max_staleness={config.trainer.max_staleness})"


def start_ray() -> None:
    """A local Ray cluster of our own (never one another engineer is running on this machine)."""
    import ray

    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        resources={"trainer": 1},
        include_dashboard=False,
        log_to_driver=False,
        # The run's own environment, plus the repo: the proxy actor unpickles bench.handoff.VerifyingControl.
        runtime_env={"env_vars": {**runtime_env()["env_vars"], "PYTHONPATH": str(REPO)}},
    )


async def sample_in_flight(proxy, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        stats = await proxy.stats.remote()
        replicas = stats["replicas"].values()
        samples.append(([r["in_flight"] for r in replicas], sum(r["requests"] for r in replicas)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)


def generator_idle(samples: list) -> float:
    """Share of samples with nothing in flight, averaged over replicas, from the first rollout request
    on (the trainer's start-up, before any request, is not the generators' idle time)."""
    start = next((i for i, (_, total) in enumerate(samples) if total > samples[0][1]), len(samples))
    window = [in_flight for in_flight, _ in samples[start:]]
    if not window:
        return float("nan")
    per_replica = zip(*window, strict=True)
    shares = [sum(1 for n in counts if n == 0) / len(window) for counts in per_replica]
    return sum(shares) / len(shares)


async def unload_all(proxy, proxy_url: str) -> None:
    """Free the replicas' adapter slots between runs (each run publishes its own names)."""
    stats = await proxy.stats.remote()
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        for name in stats["adapters_routable"]:
            async with session.post(f"{proxy_url}/v1/unload_lora_adapter", json={"lora_name": name}) as r:
                await r.read()
    await asyncio.sleep(1.0)  # unloads run in the proxy's background


async def train_once(config, proxy) -> dict:
    """One training run of the trainer actor, under the run's lease as a driver holds it: the trainer
    writes only while it hears of its renewals (rl_cluster.core.fence)."""
    import ray

    from rl_cluster.credentials import RunSecrets
    from rl_cluster.trainer_calls import LeaseNews, trainer_actor

    lease = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url).run_lease(config.run_name)
    lease.acquire()
    news = LeaseNews()
    lease.start_renewing(news.lost, news.renewed)
    trainer = news.trainer = trainer_actor(config, proxy, RunSecrets())
    trainer.lease_news.remote(valid_for_s=lease.valid_for())
    samples: list = []
    stop = asyncio.Event()
    poller = asyncio.get_running_loop().create_task(sample_in_flight(proxy, samples, stop))
    try:
        result = await trainer.run.remote()
    finally:
        stop.set()
        await poller
        ray.kill(trainer)
        lease.release()
    result["generator_idle"] = generator_idle(samples)
    return result


def measures(result: dict, completions_per_step: int) -> dict:
    """Steady-state numbers from TRL's per-step records. Step 1 has no step time (nothing before it to
    measure from) and its rollout wait includes start-up, so the window is steps 2..N."""
    steady = [r for r in result["history"] if r["step_s"] is not None]
    step_s = [r["step_s"] for r in steady]
    wait_s = [r["rollout_wait_s"] or 0.0 for r in steady]
    dropped = sum(r["dropped_stale"] for r in result["history"])
    trained = completions_per_step * len(result["history"])
    return {
        "steps": len(result["history"]),
        "mean_step_s": sum(step_s) / len(step_s),
        "steps_per_hour": 3600 * len(step_s) / sum(step_s),
        "trainer_idle": trainer_idle(result["history"]),
        "generator_idle": result["generator_idle"],
        "dropped_share": dropped / (dropped + trained),
        "rollout_wait_s": sum(wait_s) / len(wait_s),
        "compute_s": sum(s - w for s, w in zip(step_s, wait_s, strict=True)) / len(step_s),
        "train_wall_s": result["train_wall_s"],
        # Cumulative time at the end of each step (step 1 ends at 0: the clock starts there).
        "curve": [(sum(step_s[:i]), r["reward"]) for i, r in enumerate(result["history"])],
    }


def reward_by(curve: list[tuple[float, float]], t: float) -> float:
    """Mean reward of the last fifth of the steps completed by time t."""
    done = [reward for when, reward in curve if when <= t + 1e-9 and reward is not None]
    k = max(1, len(done) // 5)
    return sum(done[-k:]) / k if done else float("nan")


async def start_proxy(servers, proxy_config, model_dir, work):
    """Our ProxyActor in front of the benchmark's servers, each registered with a control that fetches and
    verifies versions from `work`/bucket as GeneratorActor does. Returns (actor, URL)."""
    from rl_cluster.proxy.actor import ProxyActor

    bucket = Bucket(str(work / "bucket"))
    fingerprint = model_fingerprint(model_dir)
    proxy = ProxyActor.options(num_cpus=0).remote(proxy_config)
    proxy_url = await proxy.start.remote()
    for i, server in enumerate(servers):
        control = VerifyingControl(bucket, server.url, work / f"cache-r{i}", fingerprint)
        await proxy.add_replica.remote(f"r{i}", server.url, control)
    return proxy, proxy_url


async def train_side_by_side(servers, model_dir, work, configs: dict, reps: int, record) -> None:
    """On a Ray of our own and one proxy in front of `servers`: train each config once per repetition,
    the order rotating between repetitions; `record(label, config, result)` gets each run's result.
    Each run publishes its own names, freed afterwards."""
    import ray

    labels = list(configs)
    start_ray()
    try:
        proxy, proxy_url = await start_proxy(servers, configs[labels[0]].proxy, model_dir, work)
        for rep in range(reps):
            turn = rep % len(labels)  # each repetition starts with the next config
            for label in labels[turn:] + labels[:turn]:
                config = configs[label].model_copy(update={"run_name": f"{configs[label].run_name}-{rep}"})
                record(label, config, await train_once(config, proxy))
                await unload_all(proxy, proxy_url)
        await proxy.stop.remote()
    finally:
        ray.shutdown()


def summarize(results: dict[str, list[dict]], configs: dict) -> dict:
    from bench.common import median, paired_ratio

    sync, asyn = results["synchronous"], results["asynchronous"]
    keys = (
        "steps_per_hour",
        "mean_step_s",
        "trainer_idle",
        "generator_idle",
        "dropped_share",
        "rollout_wait_s",
        "compute_s",
    )
    rows = {mode: {k: median([r[k] for r in rs]) for k in keys} for mode, rs in results.items()}
    # Equal wall time: the shorter of the two runs' step clocks, per repetition.
    for mode, rs in results.items():
        other = asyn if mode == "synchronous" else sync
        rows[mode]["reward_at_equal_time"] = median(
            [
                reward_by(r["curve"], min(r["curve"][-1][0], o["curve"][-1][0]))
                for r, o in zip(rs, other, strict=True)
            ]
        )
        rows[mode]["reward_last_fifth"] = median([reward_by(r["curve"], float("inf")) for r in rs])
    config = configs["asynchronous"]
    g, t = rows["synchronous"]["rollout_wait_s"], rows["synchronous"]["compute_s"]
    ideal = (g + t) / max(g, t)
    measured = paired_ratio([r["steps_per_hour"] for r in asyn], [r["steps_per_hour"] for r in sync])
    return {
        "rows": [{"mode": mode_label(mode, configs[mode]), **rows[mode]} for mode in results],
        "speedup": {
            "measured": measured,
            "ideal": ideal,
            "share_of_ideal": measured / ideal,
            "g_s": g,
            "t_s": t,
        },
        "config": {
            "steps": config.trainer.max_steps,
            "completions_per_step": config.trainer.completions_per_step,
            "num_generations": config.trainer.num_generations,
            "max_new_tokens": config.trainer.max_new_tokens,
            "sync_every": config.trainer.sync_every,
            "max_staleness": config.trainer.max_staleness,
            "reps": len(sync),
        },
        "curves": {mode_label(mode, configs[mode]): rs[0]["curve"] for mode, rs in results.items()},
    }
