"""`python -m rl_cluster.experience RUN [--bucket URI]` (or `rl-cluster experience`): a run's stored
experience, per adapter version.

With `--replay VERSION --model DIR [--adapter-dir DIR]`, the groups sampled under that version are
rescored under the base model (plus the adapter): per group, the mean |new - stored| logprob of the
trained tokens, the mean importance ratio, and the GRPO policy loss they would give. Arguments are parsed
before any heavy import, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import sys

TABLE_COLUMNS = [
    "segment",
    "group_id",
    "model_version",
    "adapter",
    "trained",
    "reward",
    "completion_ids",
    "staleness",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rl_cluster.commands import add_bucket_arguments

    parser.add_argument("run", help="the run's name (its directory in the bucket)")
    add_bucket_arguments(parser)
    parser.add_argument("--cache-dir", default=".cache/bucket", help="where s3 shards are downloaded to")
    replay = parser.add_argument_group("replay")
    replay.add_argument("--replay", type=int, metavar="VERSION", help="rescore the groups of this version")
    replay.add_argument(
        "--model", help="base model to rescore with, as model.path: tiny, a directory or a hub id"
    )
    replay.add_argument(
        "--adapter-dir", help="PEFT adapter directory to apply (default: the base model alone)"
    )
    replay.add_argument("--max-groups", type=int, default=8, help="groups of that version to rescore")
    replay.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass")


def run(args: argparse.Namespace) -> int:
    """A run's stored experience, per adapter version; with --replay, one version's groups rescored."""
    from rl_cluster.errors import UsageError

    if args.replay is not None and not args.model:
        raise UsageError("--replay needs --model")
    from rl_cluster.commands import open_bucket
    from rl_cluster.core.experience import format_version_table, total_row, version_table
    from rl_cluster.errors import AdapterError
    from rl_cluster.experience import load_experience
    from rl_cluster.runs import not_found, run_names

    bucket = open_bucket(args)
    if args.run not in run_names(
        bucket, marked=False
    ):  # before blaming experience.enabled: is it the name, or the bucket?
        raise not_found(bucket, args.run)
    try:
        dataset = load_experience(bucket, args.run, cache_dir=args.cache_dir)
    except FileNotFoundError as e:  # the run is there, but no shard yet
        raise UsageError(str(e)) from e
    except AdapterError as e:  # a shard that is not what was written
        print(e, file=sys.stderr)
        return 1
    if args.replay is None:
        rows = dataset.select_columns(TABLE_COLUMNS).to_list()
        print(format_version_table(version_table(rows), total_row(rows)))
        return 0
    return _replay(dataset, args)


def main(argv: list[str] | None = None) -> int:
    from rl_cluster.commands import add_debug_argument, guarded

    parser = argparse.ArgumentParser(
        prog="python -m rl_cluster.experience", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    add_arguments(parser)
    add_debug_argument(parser)
    return guarded(run, parser.parse_args(argv))


def _replay(dataset, args) -> int:
    from rl_cluster.core.experience import replay_stats
    from rl_cluster.experience.replay import load_policy, rescore

    rows = dataset.filter(lambda v: v == args.replay, input_columns="model_version").to_list()
    keep = set(list(dict.fromkeys((r["segment"], r["group_id"]) for r in rows))[: args.max_groups])
    rows = [r for r in rows if (r["segment"], r["group_id"]) in keep]
    if not rows:
        print(f"no stored samples of version {args.replay}", file=sys.stderr)
        return 1
    from rl_cluster.errors import UsageError
    from rl_cluster.models import resolve_model

    try:  # `tiny`, a directory or a hub id, as a run's model.path
        model_dir = resolve_model(args.model)
    except FileNotFoundError as e:
        raise UsageError(f"--model {args.model}: {e}") from None
    model = load_policy(model_dir, args.adapter_dir)
    per_group, total = replay_stats(rows, rescore(model, rows, batch_size=args.batch_size))
    policy = args.adapter_dir or f"{args.model} (no adapter)"
    print(
        f"replay of {rows[0]['adapter']}: {total['groups']} groups, {total['samples']} samples rescored under {policy}"
    )
    print(
        f"{'segment':<12}  {'group':>6}  {'samples':>7}  {'tokens':>6}  {'|dlogp|':>9}  {'ratio':>8}  {'loss':>9}"
    )
    for g in [*per_group, {"segment": "all", "group_id": "-", **total}]:
        print(
            f"{g['segment']:<12}  {g['group_id']:>6}  {g['samples']:>7}  {g['tokens']:>6}  "
            f"{g['logprob_gap_mean']:>9.5f}  {g['ratio_mean']:>8.4f}  {g['loss']:>9.5f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
