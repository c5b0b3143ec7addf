"""What keeping every rollout costs: the same short asynchronous run (jobs/configs/cpu_demo.toml with
fewer steps) with experience.enabled on and off, alternating, on the same two vLLM replicas and the same
pieces as bench/async_vs_sync.py (a Ray of our own, the ProxyActor, TrainerActor). Reported: the paired
ratio of mean step times (on / off), and the Parquet bytes the store wrote per step and per group."""

from __future__ import annotations

import time

from bench.async_vs_sync import DEMO_CONFIG, measures, start_ray, train_once, unload_all
from bench.handoff import VerifyingControl
from rl_cluster.bucket import Bucket
from rl_cluster.config import load_config
from rl_cluster.models import model_fingerprint

SETTINGS = {"store on": "true", "store off": "false"}  # experience.enabled


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    import ray

    from rl_cluster.proxy.actor import ProxyActor

    stamp = time.strftime("%Y%m%d-%H%M%S")
    common = [f"trainer.max_steps={plan.train_steps}", f"bucket.uri={log_dir / 'bucket'}",
              f"bucket.cache_dir={log_dir / 'cache'}", "generator.max_loras=6", "logging.wandb=off"]  # fmt: skip
    configs = {
        label: load_config(
            DEMO_CONFIG, [*common, f"experience.enabled={on}", f"run_name=bench-xp-{i}-{stamp}"]
        )
        for i, (label, on) in enumerate(SETTINGS.items())
    }
    bucket = Bucket(str(log_dir / "bucket"))
    fingerprint = model_fingerprint(model_dir)
    results: dict[str, list[dict]] = {label: [] for label in SETTINGS}
    written: list[dict] = []
    start_ray()
    try:
        proxy = ProxyActor.options(num_cpus=0).remote(configs["store off"].proxy)
        proxy_url = await proxy.start.remote()
        for i, server in enumerate(servers):
            control = VerifyingControl(bucket, server.url, log_dir / f"cache-r{i}", fingerprint)
            await proxy.add_replica.remote(f"r{i}", server.url, control)
        labels = list(SETTINGS)
        for rep in range(plan.train_reps):
            for label in labels[rep % 2 :] + labels[: rep % 2]:
                config = configs[label].model_copy(update={"run_name": f"{configs[label].run_name}-{rep}"})
                result = await train_once(config, proxy, proxy_url)
                results[label].append(measures(result, config.trainer.completions_per_step))
                if result.get("experience"):
                    written.append({**result["experience"], "steps": len(result["history"])})
                print(f"  {label}: {results[label][-1]['mean_step_s']:.3f} s/step", flush=True)
                await unload_all(proxy, proxy_url)
        await proxy.stop.remote()
    finally:
        ray.shutdown()
    return summarize(results, written, configs["store on"])


def summarize(results: dict[str, list[dict]], written: list[dict], config) -> dict:
    from bench.common import median, paired_ratio

    on, off = results["store on"], results["store off"]
    step_bytes = median([w["bytes"] / w["steps"] for w in written])
    return {
        "rows": [
            {
                "setting": label,
                "mean_step_s": median([r["mean_step_s"] for r in rs]),
                "trainer_idle": median([r["trainer_idle"] for r in rs]),
            }
            for label, rs in results.items()
        ],  # fmt: skip
        "step_time_ratio": paired_ratio([r["mean_step_s"] for r in on], [r["mean_step_s"] for r in off]),
        "bytes_per_step": step_bytes,
        "rows_per_step": median([w["rows"] / w["steps"] for w in written]),
        "bytes_per_group": median([w["bytes"] / max(w["groups"], 1) for w in written]),
        "lost_rows": sum(w["lost_rows"] for w in written),
        "config": {
            "steps": config.trainer.max_steps,
            "completions_per_step": config.trainer.completions_per_step,
            "num_generations": config.trainer.num_generations,
            "shard_groups": config.experience.shard_groups,
            "reps": len(on),
        },  # fmt: skip
    }
