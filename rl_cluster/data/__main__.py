"""`python -m rl_cluster.data prepare --config FILE [overrides]` and `python -m rl_cluster.data tiny-math --out DIR`
(also `rl-cluster data ...`).

The config and the data files it names are checked before any heavy import, so a bad config, a missing
file or `--help` answers at once, in one line, with exit status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rl_cluster.commands import add_debug_argument

    commands = parser.add_subparsers(dest="data_command", required=True)
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
    for command in (prepare, tiny):
        add_debug_argument(command, inherited=True)


def run(args: argparse.Namespace) -> int:
    """Write the tiny MATH task, or prepare a run's dataset into the bucket (rl_cluster.data)."""
    if args.data_command == "tiny-math":
        from rl_cluster.data.tiny_math import write_task

        for split, paths in write_task(args.out, args.train_rows, args.seed, args.operations).items():
            print(f"{split}: {paths['parquet']} {paths['jsonl']}")
        return 0

    from rl_cluster.config_errors import load
    from rl_cluster.errors import UsageError

    config = load(args.config, args.overrides)
    from rl_cluster.bucket import Bucket
    from rl_cluster.commands import bucket_errors, check_writable
    from rl_cluster.data import prepare as run_prepare

    with bucket_errors(f"bucket.uri={config.bucket.uri}"):  # now, not after minutes of tokenizing
        check_writable(Bucket(config.bucket.uri, config.bucket.s3_endpoint_url))

    try:
        meta = run_prepare(config)
    except (FileNotFoundError, ValueError) as e:  # a data file or hub dataset not there; rows unusable
        raise UsageError(f"{args.config}: {e}") from e
    command = shlex.join(["python", "jobs/train_grpo.py", "--config", args.config, *args.overrides])
    print(f"prepared {meta['key']}; a run with the same config and overrides reads it:\n  {command}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from rl_cluster.commands import add_debug_argument, guarded

    parser = argparse.ArgumentParser(prog="python -m rl_cluster.data", description=__doc__.splitlines()[0])
    add_debug_argument(parser)
    add_arguments(parser)
    return guarded(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
