"""Asynchronous GRPO with LoRA adapters: one trainer, N vLLM generators, one proxy, one bucket.

    python jobs/train_grpo.py --config jobs/configs/cpu_demo.toml [section.field=value ...]
    ray job submit --working-dir . -- python jobs/train_grpo.py --config jobs/configs/<run>.toml

Joins a running Ray cluster if there is one, else starts a local one. Writes everything under
<bucket>/<run_name>/ and prints a summary table at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_cluster.config import load_config  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="run TOML under jobs/configs/")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=20")
    return parser.parse_args(argv)


async def run(config) -> dict:
    import ray

    from rl_cluster.bucket import Bucket
    from rl_cluster.cluster import connect, launch
    from rl_cluster.core.summary import summarize, summary_table
    from rl_cluster.plots import curves_png
    from rl_cluster.trainer.actor import TrainerActor

    bucket = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)
    if bucket.list_versions(config.run_name, config.run_name):
        raise SystemExit(
            f"{bucket.run_uri(config.run_name)} already holds adapters of a run named {config.run_name!r}: adapter "
            "names are never reused (vLLM keys its prefix cache by name). Pick another run_name."
        )
    bucket.write_text(config.run_name, "config.resolved.json", config.model_dump_json(indent=2))
    connect(config)
    log_dir = os.path.abspath(os.path.join(".cache", "logs", config.run_name))
    print(f"run {config.run_name}: starting {config.generator.replicas} generators and the proxy", flush=True)
    start = time.time()
    cluster = await launch(config, log_dir)
    try:
        print(
            f"proxy listening on {cluster.proxy_url}; generators ready after {time.time() - start:.0f}s",
            flush=True,
        )
        cluster.trainer = TrainerActor.options(
            name=f"{config.run_name}-trainer",
            num_cpus=config.trainer.num_cpus,
            num_gpus=config.trainer.num_gpus,
            resources={"trainer": 1},
        ).remote(config, cluster.proxy_url)
        result = await cluster.trainer.train.remote()
        stats = await cluster.proxy.stats.remote()
    finally:
        await cluster.shutdown()
        ray.shutdown()
    summary = summarize(result, stats, time.time() - start)
    summary["run_name"] = config.run_name
    bucket.write_text(config.run_name, "summary.json", json.dumps(summary, indent=2))
    bucket.write_bytes(config.run_name, "curves.png", curves_png(result["history"], config.run_name))
    print(f"\nrun {config.run_name} finished\n{summary_table(summary)}", flush=True)
    print(
        f"\nwritten to {bucket.run_uri(config.run_name)}/ (summary.json, metrics.jsonl, curves.png)",
        flush=True,
    )
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    summary = asyncio.run(run(config))
    gap = summary["served_vs_trained_gap"]
    if gap is None or gap > config.check.tolerance:
        print(f"FAILED: served-vs-trained logprob gap {gap} exceeds {config.check.tolerance}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
