"""What keeping every rollout costs: the same short asynchronous run (jobs/configs/cpu_demo.toml with
fewer steps) with experience.enabled on and off, side by side on the same two vLLM replicas and the same
pieces as bench/async_vs_sync.py (bench/training.py runs them). Reported: the paired ratio of mean step
times (on / off), and the Parquet bytes the store wrote per step and per group."""

from __future__ import annotations


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
