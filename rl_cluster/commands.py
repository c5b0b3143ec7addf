"""The commands of `rl-cluster` that have no module of their own: train, serve, scale, summary, runs.

Each is an `add_<name>_arguments(parser)` and a `<name>(args) -> exit status`; `rl-cluster` (rl_cluster.cli)
and the `jobs/*.py` scripts, which keep working under `ray job submit` where no console script is
installed, both go through them. Nothing heavy is imported before the arguments are parsed and the
config is checked, so `--help` and a config typo answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from rl_cluster.config_errors import load
from rl_cluster.errors import BucketUnavailable, RunRefused, UsageError

_OVERRIDES_HELP = "dotted overrides, e.g. trainer.max_steps=20 (anywhere among the options)"


def add_debug_argument(parser: argparse.ArgumentParser, *, inherited: bool = False) -> None:
    """--debug; `inherited`: on a subcommand, where leaving it out must not undo `rl-cluster --debug`."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS if inherited else False,
        help="show the traceback of an expected failure too",
    )


def guarded(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """run(args), with an expected failure before anything started (RunRefused, UsageError) as its lines
    on stderr and its exit status, 2; its traceback only with --debug."""
    try:
        return run(args)
    except RunRefused as e:
        if getattr(args, "debug", False):
            raise
        print(e, file=sys.stderr)
        return e.exit_status


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run TOML under jobs/configs/")
    parser.add_argument(
        "--resume",
        metavar="RUN_NAME",
        help="continue this run from its newest verified checkpoint in the bucket (to trainer.max_steps)",
    )
    parser.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)


def train(args: argparse.Namespace) -> int:
    """Train a run: 0 finished and served = trained, 1 stopped or failed, 2 refused before it started,
    3 finished but the served adapter is not the trained one (rl_cluster.core.summary.exit_status)."""
    overrides = [*args.overrides, *([f"run_name={args.resume}"] if args.resume else [])]
    config = load(args.config, overrides)
    preflight(config, resume=bool(args.resume))
    from rl_cluster.run import train_main

    return train_main(config, resume=bool(args.resume))


def preflight(config, resume: bool) -> None:
    """What would stop a run at once, checked before Ray and the generators start (a minute saved, and
    one line instead of a failed run): Ray answers at the address to join, the bucket answers (a
    directory: can be written), the run name is free (for --resume: it has a
    checkpoint), and a dataset task's prepared data is there: a new run prepares it when it is not (the
    RayJob and `ray job submit` start one command, with no step before it), a resumed one refuses. train()
    checks the name again itself.

    Under `ray job submit --working-dir`, the driver runs in a copy Ray unpacked on the head, deleted with
    its session: a relative directory bucket.uri (the default `bucket` too) would put the run there,
    where the user's checkout never sees it, so it is refused."""
    from rl_cluster.bucket import Bucket
    from rl_cluster.core.placement import is_relative_directory, ray_package_dir
    from rl_cluster.run import check_fresh_run_name, check_resumable

    package = ray_package_dir(os.getcwd())
    if package is not None and is_relative_directory(config.bucket.uri):
        raise UsageError(
            f"bucket.uri={config.bucket.uri!r} is relative, and this Ray job runs in {package}, Ray's copy of "
            "--working-dir: the run would be written there and vanish. Pass an absolute path every node "
            "mounts (bucket.uri=/mnt/rl-bucket) or s3://bucket/prefix"
        )
    check_cluster_answers(config)
    with bucket_errors(f"bucket.uri={config.bucket.uri}"):
        bucket = Bucket(config.bucket.uri, config.bucket.s3_endpoint_url)
        check_writable(bucket)
        (check_resumable if resume else check_fresh_run_name)(bucket, config.run_name)
        if config.task.prompts == "dataset":
            from rl_cluster.data import ensure_prepared, prepared_meta

            # A resumed run's checkpoint counts rows of the data it trained on: rows prepared afresh (the
            # hub's dataset may have changed since) would silently be other rows at the same cursor.
            if resume:
                prepared_meta(config)
            else:
                ensure_prepared(config)


@contextlib.contextmanager
def bucket_errors(what: str) -> Iterator[None]:
    """A bucket that cannot be used, as one UsageError line instead of a traceback: unreachable
    (BucketUnavailable), malformed (ValueError), no credentials or no permission (PermissionError), a
    file where a directory must be (NotADirectoryError: `bucket.uri=some_file/sub`), a read-only mount.
    `what` names the bucket as the user gave it."""
    retries = logging.getLogger("rl_cluster.bucket.store")
    level = retries.level
    retries.setLevel(logging.ERROR)  # its warning per retry: the one line at the end says how many failed
    try:
        yield
    except OSError as e:
        if not e.filename:  # ours or the backend's own message, written for the user already
            raise UsageError(str(e)) from e
        file = next((p for p in [Path(e.filename), *Path(e.filename).parents] if p.is_file()), None)
        # A bare ENOTDIR or EEXIST hides the cause: which part of the path is a file.
        cause = f"{file} is a file, not a directory" if file else f"{e.strerror}: {e.filename}"
        raise UsageError(f"{what}: {cause}") from e
    except (BucketUnavailable, ValueError) as e:
        raise UsageError(str(e)) from e
    finally:
        retries.setLevel(level)


def open_bucket(args: argparse.Namespace):
    """The bucket of --bucket and --s3-endpoint-url (add_bucket_arguments); a malformed one is a UsageError."""
    from rl_cluster.bucket import Bucket

    with bucket_errors(f"--bucket {args.bucket}"):
        return Bucket(args.bucket, args.s3_endpoint_url)


def check_writable(bucket) -> None:
    """A directory bucket can be made and written: else the run would fail taking its lease, after the
    config was loaded, with a traceback. An s3 bucket answered the listing already."""
    if bucket.is_remote:
        return
    root = Path(bucket.uri)
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".write-check-{os.getpid()}"  # a dot name: listings of the bucket skip it
    probe.write_bytes(b"")
    probe.unlink()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run TOML under jobs/configs/")
    parser.add_argument("--port", type=int, help="port the proxy binds (overrides proxy.port)")
    parser.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)


def serve(args: argparse.Namespace) -> int:
    """Serve the generators behind the proxy until SIGINT or SIGTERM (rl_cluster.serve)."""
    overrides = [*args.overrides, *([f"proxy.port={args.port}"] if args.port is not None else [])]
    config = load(args.config, overrides)
    check_cluster_answers(config)
    import asyncio

    from rl_cluster.serve import serve as serve_run

    asyncio.run(serve_run(config))
    return 0


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run_name of the running run")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--replicas", type=int, help="generators the pool should run")
    target.add_argument("--auto", action="store_true", help="hand the pool back to automatic scaling")
    parser.add_argument("--address", help="Ray address of the run's cluster (default: RAY_ADDRESS, or auto)")
    parser.add_argument("--no-wait", action="store_true", help="return once the controller has the target")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the pool (900)")


def scale(args: argparse.Namespace) -> int:
    """Set a running run's generator pool: 0 done, 1 no such run or not there in time, 2 N refused or no
    Ray answers at the address."""
    address, named = args.address, "--address"
    if not address:
        address, named = os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS"
    if not address or address == "auto":  # what `ray start` on this machine left for address="auto"
        with contextlib.suppress(OSError):
            named = str(Path(tempfile.gettempdir(), "ray", "ray_current_cluster"))
            address = Path(named).read_text().strip()
    if address and address != "auto":
        check_ray_answers(address, named)
    from rl_cluster.scale import scale as scale_pool

    return scale_pool(args.run, args.replicas, args.auto, args.address, not args.no_wait, args.timeout)


def check_cluster_answers(config) -> None:
    """check_ray_answers for the cluster a run or `serve` joins (connect()): cluster.address, else
    RAY_ADDRESS; `local` and `auto` start or find one themselves."""
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if address and address not in ("local", "auto"):
        check_ray_answers(address, "cluster.address" if config.cluster.address else "RAY_ADDRESS")


def check_ray_answers(address: str, named: str, timeout_s: float = 5.0) -> None:
    """UsageError, in seconds, when nothing listens at the Ray address `address` (host:port or
    ray://host:port; `named`: where it came from). ray.init retries a GCS that does not answer for over a
    minute, with warnings that name another address (loopback becomes the node's IP). Anything else
    (http://, a name Ray resolves itself) is left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or "/" in host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise UsageError(
            f"no Ray answers at {address} ({named}): {e.strerror or e}. Is the cluster up (`ray status` on "
            "its head)? Pass the address `ray start --head` printed (HOST:6379)"
        ) from e


def add_bucket_arguments(parser: argparse.ArgumentParser) -> None:
    """--bucket and --s3-endpoint-url, as every command that reads a bucket without a config takes them."""
    from rl_cluster.runs import DEFAULT_BUCKET

    parser.add_argument(
        "--bucket",
        default=DEFAULT_BUCKET,
        help=f"directory or s3://bucket/prefix (default: {DEFAULT_BUCKET}, as bucket.uri)",
    )
    parser.add_argument("--s3-endpoint-url", default=None, help="S3-compatible endpoint (for s3:// buckets)")


def add_summary_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="the run's name (its directory in the bucket)")
    add_bucket_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print summary.json itself")


def summary(args: argparse.Namespace) -> int:
    """Print a finished run's summary table again, from <bucket>/<run>/summary.json."""
    from rl_cluster.core.summary import summary_table
    from rl_cluster.runs import read_summary

    bucket = open_bucket(args)
    with bucket_errors(f"--bucket {args.bucket}"):
        found = read_summary(bucket, args.run)
    if found is None:
        raise UsageError(
            f"{bucket.run_uri(args.run)} has no summary.json: the run is still running, or its driver was "
            "lost before it could write one"
        )
    print(
        json.dumps(found, indent=2)
        if args.json
        else f"run {args.run} {found['status']}\n{summary_table(found)}"
    )
    return 0


def add_runs_arguments(parser: argparse.ArgumentParser) -> None:
    add_bucket_arguments(parser)


def runs(args: argparse.Namespace) -> int:
    """List the runs in a bucket: status, steps, final reward (mean of the last fifth of the steps) and
    the last eval's pass@1, from each run's summary.json."""
    from rl_cluster.runs import read_summary, run_names, run_row, runs_table

    bucket = open_bucket(args)
    names = run_names(bucket)
    if not names:
        print(f"no runs in {bucket.uri}")
        return 0
    print(runs_table([run_row(name, read_summary(bucket, name)) for name in names]))
    return 0
