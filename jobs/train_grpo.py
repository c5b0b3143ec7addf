"""Asynchronous GRPO with LoRA adapters: one trainer, N vLLM generators, one proxy, one bucket.

    python jobs/train_grpo.py --config jobs/configs/cpu_demo.toml [section.field=value ...]
    ray job submit --working-dir . -- python jobs/train_grpo.py --config jobs/configs/<run>.toml
    python jobs/train_grpo.py --config jobs/configs/<run>.toml --resume RUN_NAME   (continue a run)

Joins a running Ray cluster if there is one, else starts a local one. Writes everything under
<bucket>/<run_name>/ and prints a summary table at the end. Exit status: 0 finished and served =
trained, 2 served != trained, 1 stopped or failed (summary.json is written in every case).
"""

from __future__ import annotations

import argparse
import sys

from rl_cluster.config import load_config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="run TOML under jobs/configs/")
    parser.add_argument(
        "--resume",
        metavar="RUN_NAME",
        help="continue this run from its newest verified checkpoint in the bucket (to trainer.max_steps)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=20")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        overrides = [*args.overrides, *([f"run_name={args.resume}"] if args.resume else [])]
        config = load_config(args.config, overrides)
    except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"{args.config}: {e}", file=sys.stderr)
        return 1
    from rl_cluster.run import train_main

    return train_main(config, resume=bool(args.resume))


if __name__ == "__main__":
    sys.exit(main())
