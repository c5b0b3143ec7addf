"""`python -m rl_cluster.data prepare --config FILE [overrides]` and `python -m rl_cluster.data tiny-math --out DIR`.

The config is parsed before any heavy import, so a bad config or `--help` answers at once.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_cluster.data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare", help="write the recipe's train and eval splits into the bucket, where the run reads them"
    )
    prepare.add_argument(
        "--config", required=True, help="the run's TOML (the same one the run is started with)"
    )
    prepare.add_argument("overrides", nargs="*", help="dotted overrides, as for jobs/train_grpo.py")
    tiny = commands.add_parser(
        "tiny-math", help="write the locally made MATH-format task (parquet and jsonl)"
    )
    tiny.add_argument("--out", required=True, help="directory for train/test .parquet and .jsonl")
    tiny.add_argument("--train-rows", type=int, default=2000)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--operations", default="+", help="'+', '-' or '+-'")
    args = parser.parse_args(argv)

    if args.command == "tiny-math":
        from rl_cluster.data.tiny_math import write_task

        for split, paths in write_task(args.out, args.train_rows, args.seed, args.operations).items():
            print(f"{split}: {paths['parquet']} {paths['jsonl']}")
        return 0

    from rl_cluster.config import load_config

    config = load_config(args.config, args.overrides)
    from rl_cluster.data import prepare as run_prepare

    meta = run_prepare(config)
    command = shlex.join(["python", "jobs/train_grpo.py", "--config", args.config, *args.overrides])
    print(f"prepared {meta['key']}; a run with the same config and overrides reads it:\n  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
