"""`rl-cluster`: every command of the project behind one name.

    rl-cluster train --config jobs/configs/cpu_demo.toml [--resume RUN] [section.field=value ...]
    rl-cluster serve --config FILE [--port P] [overrides]     the generators behind the proxy, no training
    rl-cluster scale --run RUN [--replicas N | --auto]         a running run's generator pool
    rl-cluster data tiny-math --out data/tiny_math | data prepare --config FILE [overrides]
    rl-cluster experience RUN [--bucket URI] [--replay V --model DIR]
    rl-cluster summary RUN [--bucket URI] [--json]             a finished run's summary table, again
    rl-cluster runs [--bucket URI]                             the runs in a bucket

Exit status 2 is an expected failure before anything started (a config that does not load, data not
prepared, a run name taken or not there, a bucket that cannot be used, no Ray at the address given):
one line per problem, the traceback only with --debug (README.md has every command's statuses). `train` also exits 0 (finished, served = trained), 1 (stopped or failed)
and 3 (finished, but the served adapter is not the trained one). `jobs/*.py` are this, for `ray job
submit`, where the console script may not be installed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from rl_cluster import commands
from rl_cluster.commands import add_debug_argument, guarded
from rl_cluster.data import __main__ as data_command
from rl_cluster.experience import __main__ as experience_command

# name -> (adds its arguments, runs it, one line of help). Each command's arguments are defined once, in
# the module that runs it; the jobs/*.py scripts call `main([name, ...])`.
COMMANDS: dict[str, tuple[Callable, Callable, str]] = {
    "train": (commands.add_train_arguments, commands.train, "train a run (jobs/train_grpo.py)"),
    "serve": (commands.add_serve_arguments, commands.serve, "serve the proxy, no training (jobs/serve.py)"),
    "scale": (commands.add_scale_arguments, commands.scale, "a running run's generator pool (jobs/scale.py)"),
    "data": (data_command.add_arguments, data_command.run, "write the tiny MATH task, or prepare a dataset"),
    "experience": (experience_command.add_arguments, experience_command.run, "a run's stored rollouts"),
    "summary": (commands.add_summary_arguments, commands.summary, "print a finished run's summary again"),
    "runs": (commands.add_runs_arguments, commands.runs, "list the runs in a bucket"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl-cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_debug_argument(parser)
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, run, summary) in COMMANDS.items():
        sub = subcommands.add_parser(name, help=summary, description=run.__doc__ or summary)
        add_arguments(sub)
        add_debug_argument(sub, inherited=True)
        sub.set_defaults(handler=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come before and after the options (`--config X a=1 --port 8 b=2`); argparse hands the
    # ones after an option back as unknown.
    takes_overrides = isinstance(getattr(args, "overrides", None), list)
    if extra and (not takes_overrides or any(word.startswith("-") for word in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides += extra
    return guarded(args.handler, args)


if __name__ == "__main__":
    sys.exit(main())
