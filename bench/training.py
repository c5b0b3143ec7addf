"""The benchmarks that train (sections 5 and 7), in one Ray of our own with one proxy in front of the
benchmark's two replicas: three short runs of jobs/configs/cpu_demo.toml side by side, lockstep,
asynchronous, and asynchronous without the experience store. The asynchronous run is section 5's and
section 7's "store on" both: starting a trainer costs more than a quick plan's whole run, and a fourth run
would only repeat it."""

from __future__ import annotations

import time

from bench import async_vs_sync, experience
from bench.async_vs_sync import DEMO_CONFIG, measures, mode_label, train_side_by_side
from rl_cluster.config import load_config

RUNS = {  # label -> what differs; the async/sync pair is section 5's, the store on/off pair section 7's
    "synchronous": ["trainer.mode=sync"],
    "asynchronous": ["trainer.mode=async"],
    "store off": ["trainer.mode=async", "experience.enabled=false"],
}
SECTIONS = ("async_vs_sync", "experience")


async def run(servers, model_dir, tokenizer, plan, log_dir) -> dict:
    """{"async_vs_sync": section 5's results, "experience": section 7's}."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    common = [f"trainer.max_steps={plan.train_steps}", f"bucket.uri={log_dir / 'bucket'}",
              f"bucket.cache_dir={log_dir / 'cache'}", "generator.max_loras=6", "logging.wandb=off",
              "experience.enabled=true"]  # fmt: skip
    configs = {
        label: load_config(DEMO_CONFIG, [*common, *extra, f"run_name=bench-{i}-{stamp}"])
        for i, (label, extra) in enumerate(RUNS.items())
    }
    measured: dict[str, list[dict]] = {label: [] for label in RUNS}
    written: list[dict] = []  # what the store wrote in each run that kept it

    def record(label: str, config, result: dict) -> None:
        measured[label].append(measures(result, config.trainer.completions_per_step))
        if result.get("experience"):
            written.append({**result["experience"], "steps": len(result["history"])})
        shown = label if label == "store off" else mode_label(label, config)
        print(f"  {shown}: {measured[label][-1]['mean_step_s']:.3f} s/step", flush=True)

    await train_side_by_side(servers, model_dir, log_dir, configs, plan.train_reps, record)
    pair = ("synchronous", "asynchronous")
    return {
        "async_vs_sync": async_vs_sync.summarize(
            {mode: measured[mode] for mode in pair}, {mode: configs[mode] for mode in pair}
        ),
        "experience": experience.summarize(
            {"store on": measured["asynchronous"], "store off": measured["store off"]},
            written,
            configs["asynchronous"],
        ),
    }
