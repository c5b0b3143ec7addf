"""What keeping every rollout costs: the same short asynchronous run (jobs/configs/cpu_demo.toml with
fewer steps) with experience.enabled on and off, alternating, on the same two vLLM replicas and the same
pieces as bench/async_vs_sync.py (a Ray of our own, the ProxyActor, TrainerActor). Reported: the paired
ratio of mean step times (on / off), and the Parquet bytes the store wrote per step and per group."""

from __future__ import annotations

import time

from bench.async_vs_sync import DEMO_CONFIG, measures, train_side_by_side
from rl_cluster.config import load_config

SETTINGS = {"store on": "true", "store off": "false"}  # experience.enabled


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    common = [f"trainer.max_steps={plan.train_steps}", f"bucket.uri={log_dir / 'bucket'}",
              f"bucket.cache_dir={log_dir / 'cache'}", "generator.max_loras=6", "logging.wandb=off"]  # fmt: skip
    configs = {
        label: load_config(
            DEMO_CONFIG, [*common, f"experience.enabled={on}", f"run_name=bench-xp-{i}-{stamp}"]
        )
        for i, (label, on) in enumerate(SETTINGS.items())
    }
    results: dict[str, list[dict]] = {label: [] for label in SETTINGS}
    written: list[dict] = []

    def record(label: str, config, result: dict) -> None:
        results[label].append(measures(result, config.trainer.completions_per_step))
        if result.get("experience"):
            written.append({**result["experience"], "steps": len(result["history"])})
        print(f"  {label}: {results[label][-1]['mean_step_s']:.3f} s/step", flush=True)

    await train_side_by_side(servers, model_dir, log_dir, configs, plan.train_reps, record)
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
        "step_time_ratios": [a["mean_step_s"] / b["mean_step_s"] for a, b in zip(on, off, strict=True)],
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
